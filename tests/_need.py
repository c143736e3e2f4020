"""Imports a test needs, failing (never skipping) with what to install when one is missing.

    from _need import need
    cv2 = need("cv2", "pip install opencv-python-headless (or: make venv)")

``pytest.importorskip`` turns a missing dependency into a silent skip; ``make test`` installs everything the
suite needs, so a missing module is a broken environment and must show up as a failure.
"""
from __future__ import annotations

import importlib
from typing import Any

import pytest


def need(module: str, install: str) -> Any:
    """``import module`` or fail the test (or the whole file, at module level) saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:  # ModuleNotFoundError, or a compiled extension that cannot load its libraries
        why = f"{type(e).__name__}: {e}"
    pytest.fail(f"this test needs {module!r}, which does not import here ({why}). Install it: {install}",
                pytrace=False)


__all__ = ["need"]
