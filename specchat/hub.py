"""The Hugging Face hub: snapshots of model and head repositories, local cache first.

A hub id (`org/name`) is fetched through the hub client. When the hub is out of reach (offline
machines, `HF_HUB_OFFLINE=1`), only what the local hub cache already holds is used, after one
short connection attempt instead of the client's half-minute of retries.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from specchat.errors import SpecchatError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PROBE_SECONDS = 3.0  # one connection attempt, instead of the hub client's ~30 s of retries


class HubError(SpecchatError, RuntimeError):
    """A hub repository could not be fetched (offline and not cached, or refused)."""


def hub_reachable() -> bool:
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=HUB_PROBE_SECONDS).close()
    except OSError:
        return False
    return True


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not hub_reachable()


def hub_folder(repo: str, allow_patterns: list[str], hint: str = "") -> str:
    """A local snapshot of a hub repository: from the hub cache when offline, else downloaded."""
    # the hub client (its HTTP stack and API, ~0.15 s to import) loads where a hub id is fetched:
    # an embedded model, a GGUF file or a local folder never needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo, local_files_only=_offline(), allow_patterns=allow_patterns)
    except LocalEntryNotFoundError as error:
        raise HubError(f"cannot reach the Hugging Face hub to fetch {repo!r} and it is not in the local hub cache{hint}") from error
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise HubError(f"cannot fetch {repo!r} from the Hugging Face hub: {error}") from error


def hub_file(repo: str, filename: str, hint: str = "") -> Path:
    """One file of a hub repository, from the hub cache when offline, else downloaded."""
    from huggingface_hub import hf_hub_download  # (as in `hub_folder`: where a hub id is fetched)
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, filename, local_files_only=_offline()))
    except LocalEntryNotFoundError as error:
        raise HubError(f"cannot reach the Hugging Face hub to fetch {repo}/{filename} and it is not in the local hub cache{hint}") from error
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise HubError(f"cannot fetch {repo}/{filename} from the Hugging Face hub: {error}") from error
