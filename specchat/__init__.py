"""specchat: chat with a local LLM, faster, through lossless speculative decoding."""

import importlib.util
from pathlib import Path

__version__ = "0.1.0"

# The head architectures are the top-level package `drafters`, installed with specchat. PyPI also
# has an unrelated distribution of that name (drafters 0.0.1, a few protocol classes): installed
# beside specchat it overwrites our drafters/__init__.py, or shadows the whole package when specchat
# is installed editable. Say so in one line rather than fail later on a missing name. (Reading
# the file's text, not importing it: importing our drafters loads torch, which the command line
# defers.)
_drafters = importlib.util.find_spec("drafters")
if _drafters is None or _drafters.origin is None or \
        "def load_head(" not in Path(_drafters.origin).read_text(encoding="utf-8", errors="replace"):
    where = f" ({_drafters.origin})" if _drafters is not None and _drafters.origin else ""
    raise ImportError(f"specchat's `drafters` package is missing or shadowed by another package of that name{where}: "
                      f"run `pip uninstall drafters`, then reinstall specchat")
