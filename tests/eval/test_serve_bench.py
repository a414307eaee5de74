"""`specdec bench serve` against a real `specdec serve` app (tiny model) on loopback, single requests
and multi-turn conversations (with a recorder in front of the app to see what the bench sends)."""

from __future__ import annotations

import json
from collections import Counter
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


def _tiny_app(tiny_dirs):
    server_mod = pytest.importorskip("specdec.api.server", reason="the HTTP server is not built yet")
    from specdec.api.state import ServerSettings
    from specdec.config import EngineConfig
    from specdec.engine import Engine

    target, draft = tiny_dirs
    config = EngineConfig(target=str(target), draft=str(draft), dtype="float32", kv_cache_memory_gib=0.05)
    return server_mod.create_app(Engine(config), ServerSettings(model_name="tiny"))


@pytest.fixture(scope="module")
def server(tiny_dirs):
    with ServerThread(_tiny_app(tiny_dirs)) as srv:
        yield srv


class ChatRecorder:
    """An ASGI wrapper that keeps every chat request body and the text its stream carried."""

    def __init__(self, app) -> None:
        self.app = app
        self.exchanges: list[tuple[dict, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        body, sent = bytearray(), bytearray()

        async def recv():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        async def snd(message):
            if message["type"] == "http.response.body":
                sent.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, recv, snd)
        text = "".join(
            chunk_text(json.loads(line[len("data:"):])) for line in sent.decode().splitlines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"
        )
        self.exchanges.append((json.loads(body), text))


@pytest.fixture(scope="module")
def recorded_server(tiny_dirs):
    """A fresh server (empty prefix cache) behind a `ChatRecorder` (as `.recorder`)."""
    recorder = ChatRecorder(_tiny_app(tiny_dirs))
    with ServerThread(recorder) as srv:
        srv.recorder = recorder
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


def test_bench_serve_multi_turn_with_and_without_prefix_caching(
    tmp_path, tiny_dirs, sharegpt_multi_turn_file, recorded_server
):
    out = tmp_path / "multi"
    argv = ["bench", "serve", "--multi-turn", "--base-url", recorded_server.url, "--tokenizer", str(tiny_dirs[0]),
            "--dataset-path", str(sharegpt_multi_turn_file), "--limit", "3", "--max-turns", "3",
            "--request-rates", "inf", "--output-len", "6", "--ignore-eos", "--max-prompt-len", "200",
            "--seed", "0", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    data = json.loads((out / "serve_multi_turn.json").read_text())
    assert "--endpoint /v1/chat/completions" in data["meta"]["command"]
    result = data["results"]
    num_turns = sum(len(c["turns"]) for c in result["conversations"])
    assert len(result["conversations"]) == 3 and num_turns > 3
    (run,) = result["runs"]
    cache, cold = run["passes"]["cache"], run["passes"]["no-cache"]
    for p in (cache, cold):
        assert p["completed"] == num_turns and p["failed"] == 0, p["errors"]
        assert p["completed_conversations"] == 3
        assert p["by_turn"]["first"]["turns"] == 3 and p["by_turn"]["later"]["turns"] == num_turns - 3
        for turns in ("first", "later"):
            for key in ("ttft_ms", "tpot_ms", "itl_ms"):
                assert 0 < p["by_turn"][turns][key]["p50"] <= p["by_turn"][turns][key]["p99"]
        records = sorted(p["turn_records"], key=lambda r: (r["conversation"], r["turn"]))
        for a, b in zip(records, records[1:]):
            if a["conversation"] == b["conversation"]:  # each turn resends a longer history
                assert b["turn"] == a["turn"] + 1 and b["prompt_tokens"] > a["prompt_tokens"] + a["output_tokens"]
    assert cache["by_turn"]["later"]["prefix_hit_rate"] > 0 and cache["prefix_hit_rate"] > 0
    assert cold["prefix_hit_rate"] == 0 and cold["cached_tokens"] == 0
    assert all(r["cached_tokens"] == 0 for r in cold["turn_records"])
    assert run["warnings"] == []

    exchanges = recorded_server.recorder.exchanges
    salts = Counter(body["cache_salt"] for body, _ in exchanges)
    (pass_salt, shared), *singles = salts.most_common()
    assert shared == num_turns  # the cached pass: one salt of its own for all its requests
    assert len(singles) == num_turns + 1 and {n for _, n in singles} == {1}  # uncached pass, probe
    cached = lambda body: body["cache_salt"] == pass_salt  # noqa: E731
    answers = {(json.dumps(body["messages"]), cached(body)): text for body, text in exchanges}
    later = [body for body, _ in exchanges if len(body["messages"]) > 1]
    assert len(later) == 2 * (num_turns - 3)
    for body in later:
        *history, answer, question = body["messages"]
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * len(history[::2]) + ["user"]
        assert answer["role"] == "assistant" and question["role"] == "user"
        # the answer resent is exactly what the server streamed for that history, in the same pass
        assert answers[(json.dumps(history), cached(body))] == answer["content"]
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 6

    table = (out / "serve_multi_turn.md").read_text()
    assert "with caching" in table and "without caching" in table and "prefix hit rate" in table
    assert (out / "serve_multi_turn.png").is_file()


def test_bench_serve_multi_turn_refuses_the_completions_endpoint(tmp_path, tiny_dirs, sharegpt_multi_turn_file, capsys):
    argv = ["bench", "serve", "--multi-turn", "--endpoint", "/v1/completions", "--tokenizer", str(tiny_dirs[0]),
            "--dataset-path", str(sharegpt_multi_turn_file), "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 2
    assert "--multi-turn" in capsys.readouterr().err
    argv[3:5] = ["--max-turns", "1"]
    assert main(argv) == 2
    assert "--max-turns" in capsys.readouterr().err


class _Bar:
    def update(self, n: int) -> None:
        pass


def _fake_chat_app(fail_at_turn: int | None, seen: list[dict]):
    """A minimal ASGI chat server: answers `answer-<turn>` in two chunks with usage (cached tokens
    half the prompt under the pass's shared salt "pass", none under a fresh one); answers 400 at
    user turn `fail_at_turn`."""

    async def app(scope, receive, send):
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        seen.append(request)
        turn = sum(1 for m in request["messages"] if m["role"] == "user")
        if turn == fail_at_turn:
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "too long"}}'})
            return
        prompt = 10 * len(request["messages"])
        usage = {"prompt_tokens": prompt, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": prompt // 2 if request.get("cache_salt") == "pass" else 0}}
        chunks = [{"choices": [{"delta": {"content": f"answer-{turn}"}}]},
                  {"choices": [{"delta": {"content": "!"}}]}, {"choices": [], "usage": usage}]
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": data.encode()})

    return app


@pytest.mark.parametrize("salted", [False, True])
def test_conversation_resends_history_and_stops_after_a_failed_turn(salted):
    import asyncio

    from specdec.eval.datasets import Conversation, Turn
    from specdec.eval.serve_bench import ServeBenchOptions, pass_metrics, run_conversation

    conversation = Conversation("c", tuple(Turn(f"q{i}", 2, 5) for i in range(1, 5)))
    opts = ServeBenchOptions(multi_turn=True, max_turns=4)

    async def run(fail_at_turn):
        seen: list[dict] = []
        transport = httpx.ASGITransport(app=_fake_chat_app(fail_at_turn, seen))
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            turns = await run_conversation(client, opts, "m", 0, conversation, salted, lambda s: len(s), _Bar(), "pass")
        return turns, seen

    turns, seen = asyncio.run(run(None))
    assert [t.turn for t in turns] == [1, 2, 3, 4] and all(t.trace.success for t in turns)
    assert seen[2]["messages"] == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "answer-1!"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "answer-2!"},
        {"role": "user", "content": "q3"},
    ]
    assert all(body["max_tokens"] == 5 for body in seen)
    salts = [body.get("cache_salt") for body in seen]
    assert (len(set(salts)) == 4) if salted else (salts == ["pass"] * 4)
    assert [t.trace.prompt_tokens for t in turns] == [10, 30, 50, 70]
    assert [t.trace.cached_tokens for t in turns] == ([0] * 4 if salted else [5, 15, 25, 35])

    turns, seen = asyncio.run(run(2))
    assert len(seen) == 2 and [t.trace.success for t in turns] == [True, False, False, False]
    assert "HTTP 400" in turns[1].trace.error and turns[3].trace.error == "an earlier turn failed"
    result = pass_metrics(turns, 1.0, opts)
    assert result["completed"] == 1 and result["failed"] == 3
    assert result["conversations"] == 1 and result["completed_conversations"] == 0
    assert result["by_turn"]["first"]["completed"] == 1 and result["by_turn"]["later"]["completed"] == 0
    assert len(result["errors"]) == 2 and "an earlier turn failed" in result["errors"]


def test_bench_chat_measures_turns_and_a_streams_gaps(server):
    """`specdec bench chat` against a tiny server: turn 2 resends turn 1 and finds it cached; the
    running stream's gaps and the arriving prompt's TTFT are measured."""
    import asyncio

    from specdec.eval.chat_bench import ChatBenchOptions, markdown, run_chat_bench

    opts = ChatBenchOptions(base_url=server.url, max_tokens=4, stream_tokens=300, warmup_chunks=3,
                            source_chars=120, timeout=120)
    result = asyncio.run(run_chat_bench(opts))
    t1, t2 = result["turns"]["turn1"], result["turns"]["turn2"]
    assert t1["cached_tokens"] == 0 and t2["prompt_tokens"] > t1["prompt_tokens"]
    assert t2["cached_tokens"] >= t1["prompt_tokens"] // 2
    i = result["interference"]
    assert i["median_gap_before_s"] > 0 and i["worst_gap_during_s"] > 0 and i["long_prompt_ttft_s"] > 0
    assert "turn 2 TTFT" in markdown(result)
    with pytest.raises(ValueError, match="warmup-chunks"):
        ChatBenchOptions(warmup_chunks=1)


def test_bench_serve_routers_need_multi_turn_and_known_names(tmp_path, tiny_dirs, sharegpt_multi_turn_file, capsys):
    argv = ["bench", "serve", "--routers", "prefix", "--tokenizer", str(tiny_dirs[0]),
            "--dataset-path", str(sharegpt_multi_turn_file), "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 2
    assert "--multi-turn" in capsys.readouterr().err
    assert main(argv[:2] + ["--multi-turn"] + argv[2:3] + ["sticky"] + argv[4:]) == 2
    assert "round-robin" in capsys.readouterr().err
