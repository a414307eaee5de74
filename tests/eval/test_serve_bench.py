"""`specdec bench serve` against a real `specdec serve` app (tiny model) on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from specdec.api.cli import main
from specdec.eval.serve_bench import chunk_text

class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread; a context manager."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started or httpx.get(self.url + "/health", trust_env=False).status_code != 200:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(tiny_dirs):
    server_mod = pytest.importorskip("specdec.api.server", reason="the HTTP server is not built yet")
    from specdec.api.state import ServerSettings
    from specdec.config import EngineConfig
    from specdec.engine import Engine

    target, draft = tiny_dirs
    config = EngineConfig(target=str(target), draft=str(draft), dtype="float32", kv_cache_memory_gib=0.05)
    with ServerThread(server_mod.create_app(Engine(config), ServerSettings(model_name="tiny"))) as srv:
        yield srv


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_measures_vllm_metrics(tmp_path, tiny_dirs, sharegpt_file, server, endpoint):
    out = tmp_path / "serve"
    argv = ["bench", "serve", "--base-url", server.url, "--endpoint", endpoint,
            "--tokenizer", str(tiny_dirs[0]),
            "--dataset-path", str(sharegpt_file),
            "--limit", "4", "--request-rates", "inf", "20", "--output-len", "6", "--max-prompt-len", "120",
            "--goodput", "ttft:60000", "tpot:60000", "--seed", "3", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "serve.json").read_text())
    assert data["results"]["model"] == "tiny"
    runs = data["results"]["runs"]
    assert [r["request_rate"] for r in runs] == [float("inf"), 20.0]
    for r in runs:
        assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
        assert 0 < r["total_output_tokens"] <= 4 * 6
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
        for key in ("ttft_ms", "e2el_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p99"]
        assert r["e2el_ms"]["mean"] >= r["ttft_ms"]["mean"]
    assert {"serve.md", "serve.png"} <= {p.name for p in out.iterdir()}


def test_bench_serve_says_when_no_server_listens(tmp_path, tiny_dirs, sharegpt_file, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
    argv = ["bench", "serve", "--base-url", url, "--tokenizer", str(tiny_dirs[0]), "--limit", "1",
            "--dataset-path", str(sharegpt_file),
            "--max-prompt-len", "120", "--out", str(tmp_path), "--no-progress"]
    try:
        assert main(argv) == 2
    finally:
        sock.close()
    assert "specdec serve" in capsys.readouterr().err


def test_chunk_text_reads_completions_and_chat_chunks():
    assert chunk_text({"choices": [{"text": "ab"}]}) == "ab"
    assert chunk_text({"choices": [{"delta": {"content": "cd"}}]}) == "cd"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
