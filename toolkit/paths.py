"""Where the toolkit keeps what it builds: one root, `$TOOLKIT_CACHE` (default ~/.cache/toolkit)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """The default random model, Inductor's caches and built kernels live in folders under this."""
    return Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "toolkit")
