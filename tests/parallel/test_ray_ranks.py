"""A parallel target's ranks as Ray actors (`--parallel-ranks ray`), on a local Ray: the same
logits and tokens as one process with TP's all-reduce through gloo (the path of ranks on other
machines) and PP, the ranks' CPUs back after close, a killed rank actor a clear error, ranks Ray
cannot place a clear error; and `serve --replicas 1 --tp 2` (the all-reduce through memory),
whose replica is replaced with a new group when a rank dies."""

from __future__ import annotations

import functools
import os
import signal
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="Ray ranks need Ray: pip install -e '.[cluster]'")
serve = pytest.importorskip("ray.serve")

from specdec import SamplingParams  # noqa: E402
from specdec.parallel.comm import RankFailure  # noqa: E402

from .conftest import GREEDY, PROMPTS, engine, prompt_logits  # noqa: E402

CPUS = 4


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)
    yield
    serve.shutdown()
    ray.shutdown()


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("layout,shm", [({"tensor_parallel_size": 2}, "0"), ({"pipeline_parallel_size": 2}, "1")],
                         ids=["tp-gloo", "pp"])  # (TP through shared memory on Ray: the serve test below)
def test_ray_ranks_match_one_process(local_ray, pair, reference, layout, shm, monkeypatch):
    monkeypatch.setenv("SPECDEC_PARALLEL_SHM", shm)
    e = engine(pair, parallel_ranks="ray", **layout)
    group = e.target.group
    try:
        assert free_cpus() == CPUS - 1  # the rank's bundle: one CPU reserved (a thread each of 2 cores)
        assert all(type(r).__name__ == "RayRank" for r in group.ranks)
        assert (group.region is not None) == (shm == "1" and "tensor_parallel_size" in layout)
        got = prompt_logits(e, reference["ids"], 3)
        assert (got - reference["logits"]).abs().max().item() < 1e-5
        assert [o.token_ids for o in e.generate(PROMPTS, GREEDY)] == reference["tokens"]
    finally:
        e.close()
    assert wait_until(lambda: free_cpus() == CPUS, 30), "the rank's actor or placement group outlived close()"


def test_a_killed_rank_actor_is_a_clear_error(local_ray, pair):
    e = engine(pair, parallel_ranks="ray", tensor_parallel_size=2, parallel_timeout_s=20)
    try:
        e.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
        ray.kill(e.target.group.ranks[0].actor)
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            e.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))
        assert time.monotonic() - start < 20
        cause = info.value if isinstance(info.value, RankFailure) else info.value.__cause__
        assert isinstance(cause, RankFailure), info.value
        assert "Ray actor" in str(cause), str(cause)
        assert e.target.pool.num_used == 0
    finally:
        e.close()
    assert wait_until(lambda: free_cpus() == CPUS, 30)


def test_ranks_ray_cannot_place_are_a_clear_error(local_ray, pair, monkeypatch):
    from specdec.parallel import launch

    monkeypatch.setattr(launch, "PLACEMENT_TIMEOUT_S", 2.0)
    blocker = ray.util.placement_group([{"CPU": CPUS - 1}])  # one CPU left: 3 stages need 3 or more
    ray.get(blocker.ready())
    try:
        with pytest.raises(RuntimeError, match=r"could not place 3 rank.*\(1 CPUs free"):
            engine(pair, parallel_ranks="ray", pipeline_parallel_size=4)
    finally:
        ray.util.remove_placement_group(blocker)
    assert wait_until(lambda: free_cpus() == CPUS, 30)


def test_serve_replica_with_two_ranks_is_replaced_when_a_rank_dies(local_ray, pair, tmp_path):
    from specdec.api.cluster.app import APP_NAME, ClusterOptions, build_app, build_engine
    from specdec.api.state import ServerSettings
    from specdec.config import EngineConfig

    from ..api.test_cluster import free_port

    target, draft = pair
    config = EngineConfig(target=target, draft=draft, dtype="float32", num_blocks=64, tensor_parallel_size=2,
                          parallel_ranks="ray", parallel_timeout_s=10)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = ClusterOptions(replicas=1, replica_cpus=2, health_check_period_s=1.0, ranks=2)
    app = build_app(functools.partial(build_engine, config), ServerSettings(model_name="tiny"), options)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, trust_env=False)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}

    def answer() -> str | None:
        try:
            response = client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            return None
        return response.json()["choices"][0]["text"] if response.status_code == 200 else None

    assert wait_until(lambda: answer() is not None, 120), "the replica with two ranks never answered"
    first = answer()
    (pid,) = _rank_pids()  # the replica's rank 1, a Ray actor
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: answer() == first and _rank_pids() not in ([], [pid]), 120), \
        "the replica was not replaced with a new group of ranks"
    client.close()


def _rank_pids() -> list[int]:
    """The processes of the rank actors on this machine (Ray titles them `ray::_RankActor...`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::_RankActor"):
                        pids.append(int(entry))
            except OSError:
                pass
    return sorted(pids)
