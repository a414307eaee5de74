"""Where specdec keeps what it builds once: converted models, quantized weights, kernels.

A leaf: it imports nothing of specdec, so the cache, the kernels and the loaders can all use it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The specdec cache folder: `$SPECDEC_CACHE`, else `~/.cache/specdec`."""
    env = os.environ.get("SPECDEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"
