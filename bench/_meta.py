"""What a benchmark's result header names: the commit it ran at and when (shared by the bench scripts)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def short_commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout ("" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return ""


def utc_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
