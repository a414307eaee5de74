"""The prompt's logprobs through `/v1/completions`: `echo` with `logprobs` (OpenAI's legacy
format: the prompt's tokens first, the first one's logprob null), `max_tokens: 0` (the prompt
scored, nothing generated), vLLM's `prompt_logprobs`; each equal to a plain forward's
log-softmax. And lm-evaluation-harness's `local-completions` loglikelihood task against the
server (skipped where the harness is not installed)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from specdec.target.runner import ModelRunner, Window
from specdec.target.tokenizer import encode_prompt
from tests.api.conftest import MODEL

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog"


def _reference(target, ids: list[int]) -> torch.Tensor:  # [len - 1, V]: row p scores token p + 1
    runner = ModelRunner.build(target, 8, num_blocks=16)
    table = runner.new_table()
    table.ensure_slots(len(ids))
    logits = runner.forward([Window(table, ids, len(ids))])
    table.free()
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _post(server, **body):
    response = httpx.post(server.url + COMPLETIONS, json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **body},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_scores_the_prompt(server, tiny_parts):
    target, _, tokenizer = tiny_parts
    ids = encode_prompt(tokenizer, PROMPT)  # as the server tokenizes a completion's prompt
    ref = _reference(target, ids)
    plain = _post(server, max_tokens=4)
    body = _post(server, max_tokens=4, echo=True, logprobs=2)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 4 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"][:n]) == PROMPT and lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    for p in range(n - 1):
        assert lp["token_logprobs"][p + 1] == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4)
        # keyed by text, as OpenAI's: the two most likely and the token itself (where texts differ)
        allowed = ref[p].topk(2).values.tolist() + [ref[p, ids[p + 1]].item()]
        values = lp["top_logprobs"][p + 1].values()
        assert values and all(min(abs(v - a) for a in allowed) < 1e-4 for v in values)
    assert lp["tokens"][n:] == plain_tokens(server, plain)
    # max_tokens 0: the prompt alone, scored the same; nothing generated, none counted
    scored = _post(server, max_tokens=0, echo=True, logprobs=1)
    assert scored["choices"][0]["text"] == PROMPT and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:n], abs=1e-6)
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per prompt token
    vllm = _post(server, max_tokens=1, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n
    for p in range(n - 1):
        entry = vllm[p + 1][str(ids[p + 1])]
        rank = int((ref[p] > ref[p, ids[p + 1]]).sum()) + 1
        assert entry["logprob"] == pytest.approx(ref[p, ids[p + 1]].item(), abs=1e-4) and entry["rank"] == rank
        best = int(ref[p].argmax())
        assert vllm[p + 1][str(best)]["rank"] == 1


def plain_tokens(server, plain) -> list[str]:
    body = _post(server, max_tokens=4, logprobs=0)
    assert body["choices"][0]["text"] == plain["choices"][0]["text"]
    return body["choices"][0]["logprobs"]["tokens"]


def test_lm_eval_loglikelihood_task_runs_against_the_server(server, tiny_parts, tmp_path):
    """lm-evaluation-harness (`lm_eval --model local-completions`) scores a tiny multiple-choice
    task made here (a local jsonl) through the server's `echo` + `logprobs`."""
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval)")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    _, _, tokenizer = tiny_parts
    tok_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tok_dir)
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in [
        ("The quick brown", [" fox", " dog"], 0), ("def add(a, b):", [" return", " quick"], 0),
        ("Speculative decoding: the draft", [" proposes", " lazy"], 0)]]
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "tiny_task.yaml").write_text(
        "task: specdec_tiny\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: answer\ndoc_to_choice: '{{choices}}'\n"
        "metric_list:\n  - metric: acc\n")
    results = simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={tok_dir},"
                   "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True",
        tasks=["specdec_tiny"], task_manager=TaskManager(include_path=str(tmp_path)), limit=3,
    )
    assert lm_eval is not None and 0.0 <= results["results"]["specdec_tiny"]["acc,none"] <= 1.0
