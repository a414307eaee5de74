"""A real uvicorn server on loopback, serving a tiny random engine, started and stopped by the tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from specdec.api.server import create_app
from specdec.api.state import ServerSettings
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.testing import noisy_twin, tiny_engine_parts

MODEL = "tiny"


@pytest.fixture(scope="session", autouse=True)
def _loopback_bypasses_proxies():
    """Test clients (httpx, openai, selenium) talk to 127.0.0.1 directly even where a proxy is set."""
    saved = {k: os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
    for key, value in saved.items():
        os.environ[key] = ",".join(filter(None, [value, "127.0.0.1,localhost"]))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_parts():
    target, _, tokenizer = tiny_engine_parts()
    return target, noisy_twin(target), tokenizer


@pytest.fixture(scope="session")
def make_engine(tiny_parts) -> Callable[..., Engine]:
    """Engine factory over the shared tiny pair: each call builds fresh KV pools and scheduler."""
    target, draft, tokenizer = tiny_parts

    def make(**overrides: Any) -> Engine:
        kwargs = dict(dtype="float32", num_blocks=256, block_size=8, num_speculative_tokens=4, max_num_seqs=16,
                      adaptive_k=False)  # fixed k: the metrics tests count drafts per position
        kwargs.update(overrides)
        return Engine.from_models(EngineConfig(**kwargs), target, draft, tokenizer)

    return make


class ServerThread:
    """uvicorn in a background thread on 127.0.0.1:<free port>; a context manager."""

    def __init__(self, app, wait: bool = True) -> None:
        self.app, self.wait = app, wait
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        if self.wait:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became healthy"
            time.sleep(0.02)

    @property
    def engine(self):
        return self.app.state.specdec.engine

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="session")
def serve() -> Callable[..., ServerThread]:
    """`with serve(engine_or_factory, **settings) as srv:` -> a running server, healthy unless
    `wait=False`."""

    def start(engine, wait: bool = True, **settings: Any) -> ServerThread:
        settings.setdefault("model_name", MODEL)
        return ServerThread(create_app(engine, ServerSettings(**settings)), wait)

    return start


@pytest.fixture(scope="module")
def server(serve, make_engine) -> Iterator[ServerThread]:
    """One shared server for a test module: no API key, generous limits."""
    with serve(make_engine()) as srv:
        yield srv


def kv_used(srv: ServerThread) -> dict[str, int]:
    """Blocks in use per pool, as /metrics reports them."""
    text = httpx.get(srv.url + "/metrics").text
    used = {}
    for line in text.splitlines():
        if line.startswith("specdec_kv_blocks{") and 'state="used"' in line:
            pool = line.split('pool="')[1].split('"')[0]
            used[pool] = int(float(line.rsplit(" ", 1)[1]))
    return used


def metric(srv: ServerThread, sample: str) -> float:
    """The value of one sample of /metrics, e.g. `specdec_requests_total{outcome="aborted"}`."""
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(sample)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def chat_body(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
