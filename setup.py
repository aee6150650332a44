"""Only the one thing pyproject.toml cannot say; everything else is there.

The packages are found, not listed: every folder with an __init__.py under specchat/ and drafters/
(so tests/, docs/ and the kernels/ folder of C++ sources are none), plus specchat.profiles, which
lives in the top-level profiles/ folder (pyproject's package-dir maps it) where no finder sees it
under its installed name. pyproject's [tool.setuptools.packages.find] cannot add such a package to
what it finds, hence this file.
"""

from setuptools import find_packages, setup

found = find_packages(include=["specchat", "specchat.*", "drafters", "drafters.*"])
setup(packages=sorted({*found, "specchat.profiles"}))
