"""Tensor and pipeline parallelism (`specdec.parallel`) with 2 local processes: logits and greedy
tokens against one process, a prefix-cache hit and chunked prefill, the C layer loop's
all-reduce, and ranks that die or hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from specdec import Engine, EngineConfig
from specdec.engine import StepError
from specdec.parallel.comm import RankFailure
from specdec.parallel.shard import ParallelConfigError, split

from .conftest import GREEDY, PROMPTS, engine, prompt_logits

@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_two_ranks_match_one_process(pair, reference, layout):
    e = engine(pair, **layout)
    try:
        for chunks in (1, 3):  # whole, and as chunked prefill over the cached start
            got = prompt_logits(e, reference["ids"], chunks)
            assert (got - reference["logits"]).abs().max().item() < 1e-5
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == reference["tokens"]  # speculative
        again = e.generate(PROMPTS[:1], GREEDY)[0]  # the prompt's blocks are a prefix-cache hit now
        assert again.num_cached_tokens > 0 and again.token_ids == reference["tokens"][0]
        assert e.target.pool.num_used == 0
    finally:
        e.close()
    assert all(not r.alive() for r in e.target.group.ranks)


def test_chunked_prefill_beside_decoding_streams(pair, reference):
    e = engine(pair, tensor_parallel_size=2, max_num_batched_tokens=8)
    try:
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == reference["tokens"]
    finally:
        e.close()


def test_each_rank_holds_its_part(pair):
    e = engine(pair, tensor_parallel_size=2, proposer="none")
    try:
        model, (rank1,) = e.target.model, e.target.group.rank_memory()
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        down = model.model.layers[0].mlp.down_proj.local  # split exactly: all the MLP's width, half the rows
        assert (down.in_features, down.out_features) == (128, 32)
        assert e.target.kv_cache.spec.num_kv_heads == 1
        assert rank1["layers"] == [0, 4] or rank1["layers"] == (0, 4)
    finally:
        e.close()
    e = engine(pair, pipeline_parallel_size=2, proposer="none")
    try:
        assert len(e.target.model.model.layers) == 2 and e.target.kv_cache.spec.num_layers == 2
        assert tuple(e.target.group.rank_memory()[0]["layers"]) == (2, 4)
        assert e.expire_leases() == 0  # the serving loop's call every turn: nothing to move, no error
        with pytest.raises(ValueError, match="handoff .* not supported"):
            e._movable_runners()
    finally:
        e.close()


def _fails_fast(e: Engine, timeout_s: float, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(StepError) as info:
        e.generate(PROMPTS[:2], GREEDY)
    assert time.monotonic() - start < timeout_s + 10
    assert isinstance(info.value.__cause__, RankFailure) and info.value.__cause__.fatal
    assert match in str(info.value.__cause__)
    assert e.target.pool.num_used == 0 and e.proposer.pool.num_used == 0  # the failed requests' blocks freed
    with pytest.raises(StepError):  # and the engine stays failed, at once
        e.generate(PROMPTS[:1], GREEDY)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_a_killed_rank_is_a_clear_error(pair, layout):
    e = engine(pair, parallel_timeout_s=20, **layout)
    try:
        os.kill(e.target.group.rank_memory()[0]["pid"], signal.SIGKILL)
        _fails_fast(e, 20, "rank 1")
    finally:
        e.close()


def test_a_hung_rank_times_out(pair):
    e = engine(pair, tensor_parallel_size=2, parallel_timeout_s=3)
    pid = e.target.group.rank_memory()[0]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)
        _fails_fast(e, 3, "did not answer within 3 s")
    finally:
        os.kill(pid, signal.SIGCONT)
        e.close()
    assert not e.target.group.ranks[0].alive()


def test_configurations_that_do_not_split(pair):
    with pytest.raises(ValueError, match="together"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="1..32"):
        EngineConfig(tensor_parallel_size=0)
    start = time.monotonic()
    with pytest.raises(ParallelConfigError, match="query heads do not divide by 3"):
        engine(pair, tensor_parallel_size=3)
    with pytest.raises(ParallelConfigError, match="4 layers cannot fill 5"):
        engine(pair, pipeline_parallel_size=5)
    assert time.monotonic() - start < 5  # refused before any rank starts
    assert [split(35, r, 2) for r in (0, 1)] == [(0, 18), (18, 35)]


def test_regions_of_dead_drivers_are_swept(tmp_path):
    """A driver killed before its ranks joined leaves its region's name; the next group's start
    removes it (and nothing of a live driver's, nor a region just being made)."""
    import struct
    import subprocess
    import sys

    from specdec.parallel.comm import PIDS, SHM_PREFIX, sweep_stale_regions

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True, check=True).stdout)

    def region(name: str, pid: int):
        data = bytearray(4096)
        struct.pack_into("i", data, PIDS, pid)
        path = tmp_path / f"{SHM_PREFIX}{name}"
        path.write_bytes(bytes(data))
        return path

    gone, mine, fresh = region("gone", dead_pid), region("mine", os.getpid()), region("fresh", 0)
    other = tmp_path / "someone-else"
    other.write_bytes(b"x")
    assert sweep_stale_regions(str(tmp_path)) == [str(gone)]
    assert not gone.exists() and mine.exists() and fresh.exists() and other.exists()
