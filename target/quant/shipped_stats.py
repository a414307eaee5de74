"""SmoothQuant statistics shipped for known checkpoints: their first load skips the calibration.

The `"w8a8"` target's first load spent 55 s of its 112 s (Qwen2.5-Coder-1.5B, 2 cores) in one
float forward over `calibration.txt`, for one vector per linear input: the per-channel max |x|
that `smoothing` folds into the weights. Those vectors depend only on the checkpoint's bytes and
the calibration text, so for the embedded default target they are computed once and shipped as
package data (1.5 MB), keyed by the checkpoint's sha256 and the text's sha256. With them the
converted weights are the very bytes a calibrating load writes on the machine that made them (and
every machine now gets those bytes, where float forwards on other CPUs could round differently).
Any other checkpoint calibrates as before.

    python -m specdec.target.ship_stats default-target   # (re)make the shipped file
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.target.quant.smoothing import CALIBRATION_FILE, SMOOTHED_INPUTS

STATS_DIR = Path(__file__).with_name("calibration_stats")  # package data


@functools.cache
def _text_key() -> str:
    return hashlib.sha256(CALIBRATION_FILE.read_bytes()).hexdigest()[:12]


def stats_path(checkpoint_sha256: str) -> Path:
    """Where the statistics of the checkpoint with this sha256 are shipped (for today's text)."""
    return STATS_DIR / f"{checkpoint_sha256[:16]}-{_text_key()}.safetensors"


def load_shipped(checkpoint_sha256: str | None) -> dict[str, torch.Tensor] | None:
    """The shipped `{linear name: max|x| [K] float32}` of a checkpoint, or None."""
    if checkpoint_sha256 is None:
        return None
    path = stats_path(checkpoint_sha256)
    return load_file(str(path)) if path.is_file() else None


def save_stats(stats: dict[str, torch.Tensor], num_layers: int, path: Path) -> None:
    """Keep what smoothing reads (`SMOOTHED_INPUTS` of every layer and the LM head's input)."""
    names = [f"model.layers.{i}.{name}" for i in range(num_layers) for name in SMOOTHED_INPUTS] + ["lm_head"]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: stats[n].float().contiguous() for n in names}, str(path))
