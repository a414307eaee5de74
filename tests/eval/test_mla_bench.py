"""`python -m specdec.eval.mla_bench` runs both MLA decode paths at DeepSeek-V2-Lite's layer shapes."""

from __future__ import annotations

from specdec.eval import mla_bench


def test_the_bench_times_both_paths_and_prints_the_kv_saving(capsys):
    assert mla_bench.main(["--contexts", "16", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "latent 31,104, per-head K and V 276,480 (8.9x)" in out
    row = out.strip().splitlines()[-1].split()
    assert row[0] == "16" and float(row[2]) > 0 and float(row[3]) > 0
