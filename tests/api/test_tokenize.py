"""vLLM's POST /tokenize and /detokenize: the ids the generation endpoints would use, and back."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, chat_body
from .test_validation import assert_error

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort a list"}]


def _post(srv, path: str, body: dict, status: int = 200) -> dict:
    response = httpx.post(srv.url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    return response.json()


def test_tokenize_a_prompt_as_completions_count_it(server):
    prompt = "def quicksort(xs):"
    out = _post(server, "/tokenize", {"model": MODEL, "prompt": prompt})
    tokenizer = server.engine.info.api_tokenizer
    assert out["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["token_strs"] is None
    assert out["max_model_len"] == server.engine.info.max_model_len
    usage = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == out["count"]
    strs = _post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True})["token_strs"]
    assert strs == tokenizer.convert_ids_to_tokens(out["tokens"])


def test_tokenize_messages_as_chat_sends_them(server):
    out = _post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    usage = _post(server, "/v1/chat/completions", chat_body(max_tokens=1) | {"messages": MESSAGES})["usage"]
    assert out["count"] == usage["prompt_tokens"]
    bare = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare["count"] < out["count"] and out["tokens"][: bare["count"]] == bare["tokens"]


def test_detokenize_round_trip(server):
    tokens = _post(server, "/tokenize", {"prompt": "for i in range(10):"})["tokens"]
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": tokens}) == {"prompt": "for i in range(10):"}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
], ids=["id past vocabulary", "negative id", "prompt and messages", "neither", "generation prompt for a prompt",
        "special tokens for messages", "unknown field", "unknown model"])
def test_bad_requests(server, path, body, status, param):
    assert_error(httpx.post(server.url + path, json=body, timeout=30), status, param)


def test_public_like_vllms(serve, make_engine):
    with serve(make_engine(), api_key="sk-test") as srv:
        assert _post(srv, "/tokenize", {"prompt": "hi"})["count"] > 0
        assert httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 401
