"""Shared by the install tests: they build this project without build isolation, to take seconds."""
from __future__ import annotations

import importlib.metadata

import pytest


def require_setuptools_for_spdx() -> None:
    """pyproject's SPDX `license` string needs setuptools 77; without build isolation the installed one builds."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        major = 0
    if major < 77:
        pytest.skip("needs setuptools>=77 installed (pip install -U setuptools): the build runs without isolation")
