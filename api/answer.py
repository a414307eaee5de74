"""One choice's answer as typed events and blocks, whichever API shapes it.

`AnswerParser` chains the reasoning parser (a thinking model's `<think>` block) and the tool-call
parser (calls in the chat template's format) over the generated text, as it streams: events are
`ReasoningDelta`, `ContentDelta`, `CallStart` and `ArgumentsDelta`. `Blocks` groups them into the
blocks the Anthropic Messages and OpenAI Responses answers are made of (a reasoning block, a text
block, one block per call), telling a stream when each opens, grows and closes; a whole answer is
the same events fed at once, so a streamed answer and a whole one always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.api.harmony import HarmonyParser
from specdec.api.reasoning import ReasoningDelta, ReasoningParser
from specdec.api.tool_calls import ArgumentsDelta, CallStart, ContentDelta, Event, finish_reason, tool_call_parser

AnswerEvent = ReasoningDelta | Event


class AnswerParser:
    """Feeds on text pieces, returns `AnswerEvent`s (`reasoning`: split a `<think>` block out,
    `starts_in_reasoning` when the prompt left it open; `tool_calls`: parse calls in `call_format`
    out of the content, `tool_schemas` the functions' parameters; `harmony`: a gpt-oss answer, whose
    messages give reasoning, content and calls at once, `HarmonyParser`)."""

    def __init__(self, reasoning: bool, starts_in_reasoning: bool, tool_calls: bool,
                 call_format: str = "hermes", tool_schemas: dict[str, Any] | None = None,
                 harmony: bool = False) -> None:
        self._harmony = HarmonyParser() if harmony else None
        self._reasoning = ReasoningParser(starts_in_reasoning) if reasoning and not harmony else None
        self.tools = self._harmony if harmony else (tool_call_parser(call_format, tool_schemas) if tool_calls else None)

    def feed(self, text: str) -> list[AnswerEvent]:
        if self._harmony is not None:
            return self._harmony.feed(text)
        return self._events(*self._reasoning.feed(text)) if self._reasoning else self._events("", text)

    def finish(self) -> list[AnswerEvent]:
        if self._harmony is not None:
            return self._harmony.finish()
        events = self._events(*self._reasoning.finish()) if self._reasoning else []
        return events + (self.tools.finish() if self.tools else [])

    def finish_reason(self, reason: str) -> str:
        """`tool_calls` for an answer that ended on its own after a whole call."""
        return finish_reason(reason, self.tools) if self.tools else reason

    @property
    def cut_call(self) -> bool:
        """The answer ended inside a call whose name was already out (cut off by max_tokens)."""
        tools = self.tools
        return tools is not None and tools.truncated_call is not None and tools.num_calls > tools.num_complete

    def _events(self, reasoning: str, content: str) -> list[AnswerEvent]:
        events: list[AnswerEvent] = [ReasoningDelta(reasoning)] if reasoning else []
        if self.tools is None:
            return events + ([ContentDelta(content)] if content else [])
        return events + self.tools.feed(content)


@dataclass
class Block:
    """`kind`: "reasoning", "text" or "call"; `text`: the reasoning, the text, or the call's arguments."""

    kind: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass
class BlockEvent:
    """`what`: "start" (the block opened, `text` empty), "delta" (`text` added), "stop"."""

    what: str
    block: Block
    text: str = ""


@dataclass
class Blocks:
    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None

    def add(self, events: list[AnswerEvent]) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        for event in events:
            if isinstance(event, CallStart):
                out += self.close()
                self._open = Block("call", len(self.blocks), call_id=event.id, name=event.name)
                self.blocks.append(self._open)
                out.append(BlockEvent("start", self._open))
                continue
            kind = {ReasoningDelta: "reasoning", ContentDelta: "text", ArgumentsDelta: "call"}[type(event)]
            if self._open is None or self._open.kind != kind:
                out += self.close()
                self._open = Block(kind, len(self.blocks))
                self.blocks.append(self._open)
                out.append(BlockEvent("start", self._open))
            self._open.text += event.text
            out.append(BlockEvent("delta", self._open, event.text))
        return out

    def close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [BlockEvent("stop", block)] if block is not None else []


def whole_answer(parser: AnswerParser, text: str) -> list[Block]:
    """The blocks of a whole answer; a call cut off by max_tokens is left out (OpenAI's and
    Anthropic's answers hold complete calls only)."""
    blocks = Blocks()
    blocks.add(parser.feed(text) + parser.finish())
    if parser.cut_call:
        blocks.blocks = blocks.blocks[:-1]
    return blocks.blocks
