"""Where vx keeps what it builds (the embedded model, twins, S3 staging)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where vx keeps what it builds: $VX_CACHE_DIR, else $XDG_CACHE_HOME/vx, else ~/.cache/vx."""
    if os.environ.get("VX_CACHE_DIR"):
        return Path(os.environ["VX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vx"
