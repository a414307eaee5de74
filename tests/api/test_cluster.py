"""`serve --replicas` for real: a local Ray, Ray Serve's proxy, the ingress and 2 engine replicas
of tiny random models. Turn 2 of a conversation lands on turn 1's replica (and reports cached
tokens) with the prefix router and not with round-robin; a replica killed before the first token
costs nothing, one killed mid-stream ends that stream with an SSE error event and the next request
is served."""

from __future__ import annotations

import functools
import json
import secrets
import socket
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="the replica tests need Ray Serve: pip install -e '.[cluster]'")
serve = pytest.importorskip("ray.serve")

from specdec.api.cluster.app import APP_NAME, ClusterOptions, build_app, kill_replica, start_ray  # noqa: E402
from specdec.api.state import ServerSettings  # noqa: E402
from specdec.testing import tiny_serving_engine  # noqa: E402

from .conftest import wait_until  # noqa: E402

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.listen(free_port())

    def listen(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60, trust_env=False)

    def deploy(self, **options) -> None:
        """(Re)deploy the app with these `ClusterOptions` and wait until it answers."""
        options = ClusterOptions(**{"replicas": 2, "replica_cpus": 0.5, "stats_period_s": 0.5,
                                    "health_check_period_s": 1.0, **options})
        app = build_app(functools.partial(tiny_serving_engine), ServerSettings(model_name=MODEL), options)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        assert wait_until(lambda: self.get("/health").status_code == 200, timeout=120, interval=0.2)
        assert wait_until(lambda: len(self.status()["replicas"]) >= 2 or self._probe(), timeout=60, interval=0.2)

    def _probe(self) -> bool:
        self.chat([{"role": "user", "content": "hi"}], max_tokens=1, salt=secrets.token_hex(4))
        return False

    def get(self, path: str) -> httpx.Response:
        try:
            return self.client.get(path)
        except httpx.HTTPError as exc:
            return httpx.Response(599, text=str(exc))

    def status(self) -> dict:
        return self.client.get("/cluster").json()

    def chat(self, messages: list[dict], max_tokens: int = 8, salt: str | None = None, **headers) -> dict:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        response = self.client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    def replica_of(self, request_id_prefix: str = "") -> str | None:
        for replica in self.status()["replicas"]:
            if any(r.startswith(request_id_prefix) for r in replica["active_requests"]):
                return replica["id"]
        return None

    def requests_by_replica(self) -> dict[str, int]:
        return {r["id"]: r["requests"] for r in self.status()["replicas"]}


def serving(c: Cluster, deploy):
    """A local Ray (2 CPUs), Ray Serve's proxy on the cluster's port, `deploy()`; yields the
    cluster, then shuts it all down (a module fixture's body)."""
    start_ray(None, num_cpus=2, object_store_bytes=128 << 20, log_to_driver=False)
    for attempt in range(3):
        # the port is chosen once Ray's own processes hold theirs (a port free before ray.init was
        # taken by one of them in CI: "Failed to bind to address"); another test's Ray can still race us
        c.listen(free_port())
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": c.port})
            break
        except Exception:  # noqa: BLE001 - Ray's RayTaskError wraps the bind failure
            serve.shutdown()
            if attempt == 2:
                raise
    deploy()
    yield c
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield from serving(c, c.deploy)


def conversation(cluster: Cluster, salt: str, **headers) -> tuple[dict, dict, str, str]:
    """Two turns; returns their responses and the replica that answered each."""
    messages = [{"role": "user", "content": "def quicksort(xs): the quick brown fox jumps " * 4}]
    before = cluster.requests_by_replica()
    first = cluster.chat(messages, salt=salt, **headers)
    after_first = cluster.requests_by_replica()
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "for i in range(10): print(i * i)"}]
    second = cluster.chat(messages, salt=salt, **headers)
    after_second = cluster.requests_by_replica()
    served = lambda a, b: [r for r in b if b[r] > a.get(r, 0)]  # noqa: E731
    (r1,), (r2,) = served(before, after_first), served(after_first, after_second)
    return first, second, r1, r2


def test_the_cluster_serves_the_openai_api(cluster):
    assert cluster.get("/health").json() == {"status": "ok"}
    assert cluster.get("/v1/models").json()["data"][0]["id"] == MODEL
    status = cluster.status()
    assert status["router"] == "prefix" and len(status["replicas"]) == 2
    answer = cluster.chat([{"role": "user", "content": "hello"}], max_tokens=5)
    assert answer["usage"]["completion_tokens"] == 5


def test_turn_two_lands_on_the_replica_holding_turn_one(cluster):
    first, second, r1, r2 = conversation(cluster, secrets.token_hex(8))
    assert r1 == r2
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // 2
    metrics = cluster.get("/metrics").text
    assert 'specdec_router_decisions_total{reason="prefix_hit"}' in metrics
    assert f'specdec_replica_cached_tokens_total{{replica="{r2}"}}' in metrics


def test_round_robin_sends_turn_two_elsewhere(cluster):
    _, second, r1, r2 = conversation(cluster, secrets.token_hex(8), **{"x-specdec-router": "round-robin"})
    assert r1 != r2
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_unknown_router_header_is_a_400(cluster):
    response = cluster.client.post("/v1/chat/completions", headers={"x-specdec-router": "sticky"},
                                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and "round-robin" in response.json()["error"]["message"]


def test_bench_serve_compares_routers_on_the_cluster(cluster, tmp_path):
    """`bench serve --multi-turn --routers`: one pass per router through the x-specdec-router header.
    One conversation at a time, so round-robin sends every later turn to the other replica's cache."""
    from specdec.api.cli import main
    from specdec.testing import write_tiny_pair

    target_dir, _ = write_tiny_pair(tmp_path / "pair")
    lines = ["for i in range(10):", "print(i * i)", "The quick brown fox jumps over the lazy dog.",
             "def quicksort(xs):", "Speculative decoding: a draft proposes, the target verifies."]
    conversations = [{"id": f"c{i}", "conversations": [
        item for t in range(3) for item in ({"from": "human", "value": f"{lines[(i + t) % 5]} {lines[(i + t + 2) % 5]}"},
                                             {"from": "gpt", "value": " ".join(lines[:2])})]} for i in range(4)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conversations))
    out = tmp_path / "bench"
    argv = ["bench", "serve", "--multi-turn", "--routers", "prefix", "round-robin", "one", "--base-url", cluster.url,
            "--tokenizer", str(target_dir), "--dataset-path", str(data), "--limit", "4", "--max-turns", "3",
            "--request-rates", "inf", "--max-concurrency", "1", "--output-len", "6", "--ignore-eos",
            "--max-prompt-len", "300", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    (run,) = json.loads((out / "serve_multi_turn.json").read_text())["results"]["runs"]
    passes = run["passes"]
    assert list(passes) == ["router:prefix", "router:round-robin", "router:one"]
    for p in passes.values():
        assert p["failed"] == 0, p["errors"]
    hit = {name: p["by_turn"]["later"]["prefix_hit_rate"] for name, p in passes.items()}
    assert hit["router:prefix"] >= 0.9 * hit["router:one"] > 0
    assert hit["router:prefix"] >= 1.5 * hit["router:round-robin"]
    table = (out / "serve_multi_turn.md").read_text()
    assert "prefix router" in table and "round-robin router" in table and "one replica" in table


def stream_lines(cluster: Cluster, max_tokens: int, lines: list[str], done: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=cluster.url, timeout=120, trust_env=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
    done.set()


def start_stream(cluster: Cluster, max_tokens: int) -> tuple[list[str], threading.Event]:
    lines: list[str] = []
    done = threading.Event()
    threading.Thread(target=stream_lines, args=(cluster, max_tokens, lines, done), daemon=True).start()
    return lines, done


def content_chunks(lines: list[str]) -> list[str]:
    chunks = []
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                chunks.append(delta["content"])
    return chunks


@pytest.fixture(scope="module")
def slow_cluster(cluster):
    """The same cluster redeployed with 1 s engine steps: room to kill a replica at a chosen moment."""
    cluster.deploy(step_delay_s=1.0)
    return cluster


def test_a_replica_killed_before_the_first_token_is_replaced_by_another(slow_cluster):
    cluster = slow_cluster
    retries = cluster.status()["retries"]
    lines, done = start_stream(cluster, max_tokens=3)
    replica = None
    assert wait_until(lambda: (replica := cluster.replica_of()) is not None, timeout=20, interval=0.01)
    replica = cluster.replica_of()
    assert not content_chunks(lines), "the first token came before the kill: the test lost its race"
    kill_replica(replica)
    assert done.wait(60), "the stream never ended"
    assert not any(line.startswith("event: error") for line in lines), lines
    assert len(content_chunks(lines)) >= 1 and lines[-1] == "data: [DONE]"
    assert cluster.status()["retries"] == retries + 1


def test_a_replica_killed_mid_stream_ends_it_with_an_error_event(slow_cluster):
    cluster = slow_cluster
    assert wait_until(lambda: len(cluster.status()["replicas"]) == 2, timeout=60, interval=0.2)
    lines, done = start_stream(cluster, max_tokens=30)
    assert wait_until(lambda: content_chunks(lines) and cluster.replica_of() is not None, timeout=30, interval=0.01)
    kill_replica(cluster.replica_of())
    assert done.wait(60), "the stream hung after its replica died"
    errors = [i for i, line in enumerate(lines) if line.startswith("event: error")]
    assert errors and lines[-1] == "data: [DONE]"
    assert "failed while streaming" in lines[errors[0] + 1]
    # the next request is served (by the surviving replica, or the replacement)
    started = time.monotonic()
    answer = cluster.chat([{"role": "user", "content": "next"}], max_tokens=2)
    assert answer["usage"]["completion_tokens"] == 2 and time.monotonic() - started < 60



def test_a_client_leaving_mid_stream_frees_the_replicas_blocks(slow_cluster):
    """The disconnect crosses Ray: the ingress cancels the replica's stream, the replica aborts the
    request, and its KV blocks are free again (as the replicas report them to /metrics)."""
    cluster = slow_cluster
    assert wait_until(lambda: len(cluster.status()["replicas"]) == 2, timeout=60, interval=0.2)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox " * 8}],
            "max_tokens": 60, "stream": True, "ignore_eos": True}

    def used_blocks() -> int:
        for line in cluster.get("/metrics").text.splitlines():
            if line.startswith('specdec_kv_blocks{pool="target",state="used"}'):
                return int(float(line.rsplit(" ", 1)[1]))
        return -1

    with httpx.Client(base_url=cluster.url, timeout=60, trust_env=False) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and content_chunks([line]):
                    break  # one token in: leave (60 tokens would take a minute)
    assert wait_until(lambda: used_blocks() == 0 and cluster.replica_of() is None, timeout=15, interval=0.2), (
        used_blocks(), cluster.status())
