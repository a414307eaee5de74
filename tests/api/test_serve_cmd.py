"""`specdec serve` as a user runs it: a subprocess on loopback serving a tiny model pair from disk."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from specdec.api.cli import build_parser
from specdec.api.serve_cmd import served_name
from specdec.testing import write_tiny_pair


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "specdec.api.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The process's output once it exits; killed if it outlives `timeout` (the test then fails)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return output


def test_parser_has_serve_with_engine_flags():
    args = build_parser().parse_args(["serve", "--api-key", "k", "--max-concurrent", "3", "-k", "2",
                                      "--target", "/m/t", "--draft", "/m/d"])
    assert (args.host, args.port, args.api_key, args.max_concurrent) == ("127.0.0.1", 8000, "k", 3)
    assert args.num_speculative_tokens == 2 and args.max_body_bytes == 1 << 20


def test_served_name():
    assert served_name("default-target") == "default-target"
    assert served_name("/models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
    assert served_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


@pytest.mark.slow
def test_serve_tiny_pair_end_to_end(tmp_path):
    target, draft = write_tiny_pair(tmp_path)
    proc, url = _serve("--target", str(target), "--draft", str(draft), "--dtype", "float32",
                       "--kv-cache-memory", "0.01", "--served-model-name", "tiny", "--api-key", "sk-x")
    try:
        deadline, statuses = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                statuses.append(httpx.get(url + "/health").status_code)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            if statuses[-1] == 200:
                break
            time.sleep(0.05)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}
        auth = {"Authorization": "Bearer sk-x"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        out = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 8
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) in (0, 130), "a clean shutdown on Ctrl-C (130 = interrupted, as the CLI reports it)"


@pytest.mark.slow
def test_serve_exits_1_when_the_model_cannot_load(tmp_path):
    proc, _ = _serve("--target", str(tmp_path / "missing"), "--no-speculation")
    output = _finish(proc, 90)
    assert proc.returncode == 1, output
    assert "missing" in output
