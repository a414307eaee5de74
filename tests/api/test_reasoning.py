"""Reasoning split out of the answer (specdec.api.reasoning): the streaming parser fed in every
split agrees with the whole answer and never lets out half a tag; through a real server, a
thinking template's `<think>` block lands in `reasoning_content`, streamed and not, while a
template without thinking (or `--reasoning-parser none`) leaves the answer as it was.

The server tests run a tiny model rigged into a chain (each token of the chain names its successor
with a margin no other token comes near), so its greedy answer is known text:
`\\n` -> `<think>` -> `The` -> ` quick` -> `</think>` -> ` fox` -> EOS.
"""

from __future__ import annotations

import copy
import json
import random

import httpx
import pytest
import torch

from specdec.api.protocol import ChatFormat, ChoiceOutput, Usage
from specdec.api.reasoning import ReasoningParser, parses_reasoning, split_reasoning, starts_in_reasoning
from specdec.api.schemas import ChatMessage
from specdec.api.state import ServerSettings
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sequence import StepDelta, TokenOrigin
from specdec.testing import TINY_CHAT_TEMPLATE, noisy_twin, tiny_pair, tiny_tokenizer

from .conftest import MODEL, chat_body
from .test_sse import sse_events
from .test_tool_calls import _calls
from .test_validation import assert_error

CHAT = "/v1/chat/completions"
CASES = [  # (answer, starts in the reasoning, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nThe answer.", False, "Let me see.", "The answer."),
    ("<think>a \n b</think>c", False, "a \n b", "c"),
    ("<think>\n\n</think>\n\nThe answer.", False, None, "The answer."),  # Qwen3 not thinking
    ("The answer.", False, None, "The answer."),
    ("  The answer.", False, None, "  The answer."),
    ("<think>\nstill thinking\n", False, "still thinking", ""),  # cut off by max_tokens
    ("Let me see.\n</think>\n\nThe answer.", True, "Let me see.", "The answer."),  # DeepSeek-R1
    ("<think>Let me see.</think>The answer.", True, "Let me see.", "The answer."),
    ("Let me see.", True, "Let me see.", ""),
]
TAGLESS = [case for case in CASES if "<" not in case[3]]  # no "<" may come out but a tag's


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES + [
    ("a < b <thin", False, None, "a < b <thin"), ("<thi", False, None, "<thi"),
    ("x<think>y</think>", False, None, "x<think>y</think>"),  # a block later on is the answer's text
])
def test_a_whole_answer_splits(text, in_reasoning, reasoning, content):
    assert split_reasoning(text, in_reasoning) == (reasoning, content)


def _streamed(pieces: list[str], in_reasoning: bool) -> tuple[list[str], list[str]]:
    parser = ReasoningParser(in_reasoning)
    out = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return [r for r, _ in out if r], [c for _, c in out if c]


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", TAGLESS)
def test_split_at_every_position_streams_the_whole_answer(text, in_reasoning, reasoning, content):
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [[text[:i], text[i:j], text[j:]] for i in range(len(text)) for j in range(i, len(text) + 1)]
    rng = random.Random(0)
    for _ in range(50):
        at = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        cuts.append([text[i:j] for i, j in zip([0] + at, at + [len(text)])])
    for pieces in cuts:
        reasonings, contents = _streamed(pieces, in_reasoning)
        assert ("".join(reasonings) or None, "".join(contents)) == (reasoning, content), pieces
        assert not any("<" in piece for piece in reasonings + contents), (pieces, reasonings, contents)


def test_the_prompt_decides_where_the_answer_starts():
    assert starts_in_reasoning("auto", "<|User|>hi<|Assistant|><think>\n")  # DeepSeek-R1's template
    assert not starts_in_reasoning("auto", "<|im_start|>assistant\n")  # Qwen3's: the model opens it
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # not thinking
    assert starts_in_reasoning("deepseek_r1", "<|im_start|>assistant\n")


# --- through a server, on the chain model ---------------------------------------------------------

CHAIN = ["\n", "<think>", "The", " quick", "</think>", " fox", "<|im_end|>"]
MARGIN, WEAK = 50.0, 10.0  # `<think>` -> `The` is WEAK: a bias of 20 on `</think>` empties the block
ANSWER = "<think>The quick</think> fox"
GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n"
QWEN3 = TINY_CHAT_TEMPLATE.replace(GENERATION, GENERATION + "{% if enable_thinking is false %}"
                                   "<think>\n\n</think>\n\n{% endif %}")
# as DeepSeek-R1's: the prompt opens the block (closes an empty one when not thinking); `reasoning_effort`
# is read too
DEEPSEEK_R1 = TINY_CHAT_TEMPLATE.replace(GENERATION, GENERATION + "{% if reasoning_effort is defined %}effort: "
                                         "{{ reasoning_effort }}{% endif %}{% if enable_thinking is false %}"
                                         "<think></think>{% else %}<think>{% endif %}")
GREEDY = dict(temperature=0, max_tokens=20)


def _chain_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # as in Qwen3's vocabulary
    return tokenizer


@pytest.fixture(scope="module")
def chain_parts():
    """(target, draft, tokenizer): every layer's output zeroed, so a token's logits depend on it
    alone; each chain token's embedding is a basis vector that only its successor's lm_head row reads."""
    tokenizer = _chain_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(t) if t.startswith("<") else tokenizer.encode(t)[0] for t in CHAIN]
    assert all(tokenizer.decode([i]) == t for i, t in zip(ids, CHAIN))
    target, _ = tiny_pair("qwen2", 0, vocab_size=len(tokenizer), eos_token_id=ids[-1], bos_token_id=None)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = target.model.embed_tokens.weight.shape[1]
        for j, (token, successor) in enumerate(zip(ids, ids[1:])):
            target.model.embed_tokens.weight[token] = torch.eye(hidden)[j]
            target.lm_head.weight[:, j] = 0.0
            target.lm_head.weight[successor, j] = (WEAK if CHAIN[j] == "<think>" else MARGIN) / hidden**0.5
    return target, noisy_twin(target), tokenizer


@pytest.fixture(scope="module")
def serve_template(serve, chain_parts):
    """`with serve_template(chat_template, **settings) as srv:` over the chain model."""
    target, draft, tokenizer = chain_parts

    def start(template: str, **settings):
        config = EngineConfig(dtype="float32", num_blocks=64, block_size=8, num_speculative_tokens=3, max_num_seqs=4)
        own = copy.deepcopy(tokenizer)
        own.chat_template = template
        return serve(Engine.from_models(config, target, draft, own), **settings)

    return start


def _answer(srv, **extra) -> dict:
    response = httpx.post(srv.url + CHAT, json=chat_body(**GREEDY, **extra), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _stream(srv, **extra) -> tuple[list[dict], str | None]:
    """The content deltas (role chunk left out) and the finish reason."""
    _, events = sse_events(srv, CHAT, chat_body(**GREEDY, **extra, stream=True))
    chunks = [json.loads(data) for _, data in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    return [d for d in deltas if d], chunks[-1]["choices"][0]["finish_reason"]


def _joined(deltas: list[dict], key: str) -> str | None:
    return "".join(d.get(key) or "" for d in deltas) or None


def test_a_thinking_template_splits_the_reasoning_out(serve_template):
    with serve_template(QWEN3) as srv:
        whole = _answer(srv)
        assert whole["message"] == {"role": "assistant", "reasoning_content": "The quick", "content": "fox"}
        assert whole["finish_reason"] == "stop"
        deltas, finish = _stream(srv)
    assert finish == "stop"
    kinds = [next(iter(d)) for d in deltas]
    assert all(len(d) == 1 for d in deltas) and "reasoning_content" not in kinds[kinds.index("content"):], deltas
    assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == ("The quick", "fox")


def test_an_answer_that_starts_in_the_reasoning(serve_template):
    """DeepSeek-R1's template opens `<think>`: the model writes `The quick</think> fox`."""
    with serve_template(DEEPSEEK_R1) as srv:
        assert _answer(srv)["message"]["reasoning_content"] == "The quick"
        deltas, _ = _stream(srv)
        assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == ("The quick", "fox")


def test_enable_thinking_false_leaves_the_answer_unsplit(serve_template):
    """The template closes an empty block in the prompt: the model writes ` fox`, all content."""
    with serve_template(DEEPSEEK_R1) as srv:
        off = dict(chat_template_kwargs={"enable_thinking": False})
        assert _answer(srv, **off)["message"] == {"role": "assistant", "reasoning_content": None, "content": " fox"}
        deltas, _ = _stream(srv, **off)
        assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == (None, " fox")


def test_an_empty_think_block_is_dropped(serve_template, chain_parts):
    close = chain_parts[2].convert_tokens_to_ids("</think>")
    bias = {"logit_bias": {str(close): 20}}  # beats WEAK: `</think>` right after `<think>`
    with serve_template(QWEN3) as srv:
        assert _answer(srv, **bias)["message"] == {"role": "assistant", "reasoning_content": None, "content": "fox"}
        deltas, _ = _stream(srv, **bias)
        assert deltas == [{"content": "fox"}]


@pytest.mark.parametrize("template,settings", [(TINY_CHAT_TEMPLATE, {}), (QWEN3, {"reasoning_parser": "none"})],
                         ids=["no-thinking-template", "parser-none"])
def test_without_the_parser_the_answer_is_unchanged(serve_template, template, settings):
    with serve_template(template, **settings) as srv:
        assert _answer(srv)["message"] == {"role": "assistant", "content": ANSWER}
        deltas, _ = _stream(srv)
        assert all(set(d) == {"content"} for d in deltas) and _joined(deltas, "content") == ANSWER


def test_tool_calls_parse_from_the_content_not_the_reasoning():
    text = '<think>I could <tool_call> here.</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    fmt = ChatFormat(MODEL, parse_tool_calls=True, parse_reasoning=True)
    whole = fmt.response([ChoiceOutput(text, "stop")], Usage(1), {})["choices"][0]
    assert whole["message"]["reasoning_content"] == "I could <tool_call> here."
    assert whole["message"]["content"] is None and _calls(whole["message"]["tool_calls"]) == [("f", "{}")]
    assert whole["finish_reason"] == "tool_calls"
    streamed = ChatFormat(MODEL, parse_tool_calls=True, parse_reasoning=True)
    chunks = [c for i in range(0, len(text), 3) for c in streamed.delta_chunks(0, _delta(text[i:i + 3]))]
    deltas = [c["choices"][0]["delta"] for c in chunks + streamed.finish_chunks(0, "stop")]
    assert _joined(deltas, "reasoning_content") == "I could <tool_call> here." and not _joined(deltas, "content")
    assert [call["function"]["name"] for d in deltas for call in d.get("tool_calls", []) if "id" in call] == ["f"]


def _delta(text: str) -> StepDelta:
    return StepDelta("r", [0], [TokenOrigin.TARGET], text, 0, 0, False, pieces=[text])


def test_reasoning_effort_reaches_a_template_that_uses_it(serve_template):
    with serve_template(DEEPSEEK_R1) as srv:
        plain = httpx.post(srv.url + CHAT, json=chat_body(**GREEDY), timeout=60).json()
        high = httpx.post(srv.url + CHAT, json=chat_body(**GREEDY, reasoning_effort="high"), timeout=60).json()
        assert high["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    with serve_template(QWEN3) as srv:
        error = assert_error(httpx.post(srv.url + CHAT, json=chat_body(reasoning_effort="high"), timeout=60),
                             400, "reasoning_effort", "invalid_value")
        assert "reasoning_effort" in error["message"]
        for unused in ("thinking_budget", "enable"):  # `enable` is only part of `enable_thinking`
            assert_error(httpx.post(srv.url + CHAT, json=chat_body(chat_template_kwargs={unused: 9}), timeout=60),
                         400, f"chat_template_kwargs.{unused}", "invalid_value")
        for refused in ("tools", "a-b"):  # set by the request; not a name
            assert_error(httpx.post(srv.url + CHAT, json=chat_body(chat_template_kwargs={refused: []}), timeout=60),
                         400, "chat_template_kwargs")


def test_an_earlier_answers_reasoning_reaches_the_template():
    message = ChatMessage(role="assistant", content="fox", reasoning_content="The quick")
    assert message.as_template_dict() == {"role": "assistant", "content": "fox", "reasoning_content": "The quick"}


def test_parses_reasoning_follows_the_template():
    tokenizer = _chain_tokenizer()
    assert not parses_reasoning("auto", tokenizer) and parses_reasoning("qwen3", tokenizer)
    tokenizer.chat_template = QWEN3
    assert parses_reasoning("auto", tokenizer) and not parses_reasoning("none", tokenizer)
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerSettings(reasoning_parser="deepseek")
