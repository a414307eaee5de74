"""Remake the SmoothQuant statistics shipped for a model (`quant.shipped_stats`): calibrate it once
(the float forward over `calibration.txt`) and write the file the package ships.

    python -m specdec.target.ship_stats default-target
"""

from __future__ import annotations

import argparse

import torch

from specdec.target.checkpoint_reader import checkpoint_sha256
from specdec.target.model_files import resolve_model
from specdec.target.model_weights import calibration_ids, load_config
from specdec.target.quant.shipped_stats import save_stats, stats_path
from specdec.target.quantized_stream import stream_quantized


def main(argv: list[str] | None = None) -> None:
    """Calibrate a model (a spec as `specdec generate --target` takes) and write its shipped file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec, e.g. default-target")
    args = parser.parse_args(argv)
    folder = resolve_model(args.model)
    sha = checkpoint_sha256(folder)
    if sha is None:
        raise SystemExit(f"{args.model}: no verified sha256 for its weights; only checkpoints with one ship stats")
    config = load_config(folder)
    stats: dict[str, torch.Tensor] = {}
    stream_quantized(folder, config, "w8a8", torch.bfloat16, lambda: calibration_ids(folder), keep_stats=stats)
    save_stats(stats, config.num_layers, stats_path(sha))
    print(f"wrote {stats_path(sha)}")


if __name__ == "__main__":
    main()
