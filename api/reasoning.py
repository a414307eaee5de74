"""Reasoning, answer side: a thinking model's `<think>...</think>` block split out of the answer, as
it streams or whole (a whole answer goes through the same streaming parser, so the two agree).

Qwen3 opens the block itself (`<think>\\n...\\n</think>\\n\\nanswer`); DeepSeek-R1's template opens it
in the prompt, so the answer starts inside the reasoning and only closes it. Which of the two a
request gets follows from its rendered prompt: one that ends inside an open `<think>` starts in
the reasoning (Qwen3's template with `enable_thinking: false` closes an empty block instead, so
that answer is plain content). As llama-server does, whitespace around the reasoning and before
the content after it is dropped, so an empty block (`<think>\\n\\n</think>\\n\\n`) leaves no
reasoning at all. A block never closed (cut off by max_tokens) is all reasoning.

Streamed, text that may still be a tag (`</thi`) and whitespace that may still end the reasoning
are held back; a half tag never reaches a client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.api.tool_calls import tag_prefix_len

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# vLLM's names: deepseek_r1 takes the answer as reasoning from its first token (an R1 model may
# think without writing <think>), qwen3 only inside a block it opens or the prompt left open
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
_START, _REASONING, _CONTENT = "start", "reasoning", "content"
HARMONY_CHANNEL = "<|channel|>"  # gpt-oss's templates: reasoning on the analysis channel (`specdec.api.harmony`)


@dataclass
class ReasoningDelta:
    text: str


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template ("" without one; named templates joined)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "".join(template.values()) if isinstance(template, dict) else template


def parses_reasoning(parser: str, tokenizer: Any) -> bool:
    """`auto`: the chat template writes `<think>` (Qwen3, DeepSeek-R1) or harmony's channels
    (gpt-oss); Qwen2.5's does neither."""
    if parser == "auto":
        template = chat_template_text(tokenizer)
        return THINK_OPEN in template or HARMONY_CHANNEL in template
    return parser != "none"


def is_harmony(tokenizer: Any) -> bool:
    """The chat template writes gpt-oss's harmony messages: its answers are read by channel
    (`specdec.api.harmony`) whatever the reasoning parser."""
    return tokenizer is not None and HARMONY_CHANNEL in chat_template_text(tokenizer)


def starts_in_reasoning(parser: str, prompt: str) -> bool:
    """Whether the answer to `prompt` (the rendered chat prompt) begins inside the reasoning."""
    return parser == "deepseek_r1" or prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningParser:
    """Feeds on text pieces, returns (reasoning, content) pieces.

    >>> p = ReasoningParser(in_reasoning=False)
    >>> p.feed("<think>\\nHmm, 2+2.</th"), p.feed("ink>\\n\\n4"), p.finish()
    (('Hmm, 2+2.', ''), ('', '4'), ('', ''))
    """

    def __init__(self, in_reasoning: bool) -> None:
        self._text = ""  # held back
        self._state = _REASONING if in_reasoning else _START
        self._may_open = True  # a <think> may still come first (an R1 model may write it again)
        self._strip = True  # at the start of the reasoning, or of the content after it: drop whitespace

    def feed(self, piece: str) -> tuple[str, str]:
        self._text += piece
        if self._may_open:
            if len(self._text) < len(THINK_OPEN) and THINK_OPEN.startswith(self._text):
                return "", ""  # wait: this may open the block
            self._may_open = False
            if self._text.startswith(THINK_OPEN):
                self._text, self._state = self._text[len(THINK_OPEN):], _REASONING
            elif self._state == _START:
                self._state, self._strip = _CONTENT, False  # no block: the answer as it is
        reasoning = self._scan_reasoning() if self._state == _REASONING else ""
        if self._state != _CONTENT:
            return reasoning, ""
        if self._strip:
            self._text = self._text.lstrip()
            self._strip = not self._text
        content, self._text = self._text, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back text: of an unclosed block, reasoning; else content (a lone `<thi`)."""
        text, self._text = self._text, ""
        if self._state == _REASONING:
            return text.strip() if self._strip else text.rstrip(), ""
        return "", text

    def _scan_reasoning(self) -> str:
        """The reasoning that is surely out; moves to the content at `</think>`."""
        text = self._text.lstrip() if self._strip else self._text
        close = text.find(THINK_CLOSE)
        if close >= 0:
            self._text, self._state, self._strip = text[close + len(THINK_CLOSE):], _CONTENT, True
            return text[:close].rstrip()
        keep = len(text[:len(text) - tag_prefix_len(text, THINK_CLOSE)].rstrip())
        self._text, self._strip = text[keep:], self._strip and not keep
        return text[:keep]


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    parser = ReasoningParser(in_reasoning)
    pieces = [parser.feed(text), parser.finish()]
    reasoning = "".join(r for r, _ in pieces)
    return reasoning or None, "".join(c for _, c in pieces)
