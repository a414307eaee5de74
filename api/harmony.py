"""gpt-oss's harmony answers, answer side: the messages of an answer split into reasoning, content
and tool calls, as they stream or whole (a whole answer goes through the same streaming parser).

The prompt ends with `<|start|>assistant`; the answer is one or more messages, each a header (its
channel, and a recipient for a call) then `<|message|>` and a body:

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.                     (<|return|> ends it)
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
                                                                                 (<|call|> ends it)

The markers are special tokens the detokenizer keeps (`specdec.target.tokenizer.HARMONY_MARKERS`);
`<|return|>` and `<|call|>` are stops, so they are not in the text. The analysis channel is
reasoning; the final channel, and commentary without a recipient (a preamble the user sees), are
content; a message to `functions.NAME` (the recipient in the channel or in the role's place,
`<|start|>assistant to=functions.f<|channel|>commentary json`) is a call whose body is its JSON
arguments. Text outside any message (an answer that never opened one) is content. A call whose
arguments do not parse when the answer ends was cut off (by max_tokens): not complete.
"""

from __future__ import annotations

import json
import re

from specdec.api.reasoning import ReasoningDelta
from specdec.api.tool_calls import ArgumentsDelta, CallStart, ContentDelta, new_call_id, tag_prefix_len

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
_BODY_ENDS = (END, START, "<|return|>", "<|call|>")  # the last two only where they are not stops
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_HEADER, _BODY, _RAW = "header", "body", "raw"


class HarmonyParser:
    """Feeds on text pieces, returns `ReasoningDelta`, `ContentDelta`, `CallStart` and
    `ArgumentsDelta` events (the `ToolCallParser` interface: `num_calls`, `num_complete`,
    `truncated_call`).

    >>> p = HarmonyParser()
    >>> p.feed("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>4") + p.finish()
    [ReasoningDelta(text='Hm.'), ContentDelta(text='4')]
    """

    def __init__(self) -> None:
        self._text = ""  # held back: a header, or a body's tail that may be a marker
        self._state = _HEADER
        self._at_start = True
        self._kind = ""  # the body's: "reasoning", "content" or "call"
        self._args = ""  # the open call's arguments so far
        self.num_calls = 0
        self.num_complete = 0
        self.truncated_call: str | None = None

    def feed(self, piece: str) -> list:
        self._text += piece
        events: list = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list:
        """The held-back text: a header never completed is content only if it never looked like one."""
        events: list = []
        text, self._text = self._text, ""
        if self._state == _BODY:
            self._emit(text, events)
            self._close_body()
        elif self._state == _RAW and text:
            events.append(ContentDelta(text))
        return events

    def _step(self, events: list) -> bool:
        """Consume what is decided; False when the rest must wait for more text."""
        if self._state == _RAW:
            if self._text:
                events.append(ContentDelta(self._text))
            self._text = ""
            return False
        if self._state == _HEADER:
            if self._at_start and not _may_open(self._text):
                self._state = _RAW  # no message: the answer as it is
                return True
            at = self._text.find(MESSAGE)
            if at < 0:
                return False
            self._open_body(self._text[:at], events)
            self._text = self._text[at + len(MESSAGE):]
            return True
        ends = [(i, m) for m in _BODY_ENDS if (i := self._text.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(self._text[:at], events)
            self._text = self._text[at + (len(marker) if marker != START else 0):]
            self._close_body()
            self._state = _HEADER
            return True
        keep = max(tag_prefix_len(self._text, m) for m in _BODY_ENDS)
        self._emit(self._text[:len(self._text) - keep], events)
        self._text = self._text[len(self._text) - keep:]
        return False

    def _open_body(self, header: str, events: list) -> None:
        self._state, self._at_start = _BODY, False
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None and recipient.group(1).startswith("functions."):
            self._kind, self._args = "call", ""
            events.append(CallStart(self.num_calls, new_call_id(), recipient.group(1).removeprefix("functions.")))
            self.num_calls += 1
        elif recipient is None and channel is not None and channel.group(1) in ("final", "commentary"):
            self._kind = "content"
        else:
            self._kind = "reasoning"  # analysis, or a message to a tool specdec does not run

    def _emit(self, text: str, events: list) -> None:
        if not text:
            return
        if self._kind == "call":
            self._args += text
            events.append(ArgumentsDelta(self.num_calls - 1, text))
        else:
            events.append((ContentDelta if self._kind == "content" else ReasoningDelta)(text))

    def _close_body(self) -> None:
        if self._kind == "call":
            try:
                json.loads(self._args)
                self.num_complete += 1
            except ValueError:
                self.truncated_call = self._args
        self._kind = ""


def _may_open(text: str) -> bool:
    """Whether `text`, the answer so far, is or may become a message header."""
    head = text.lstrip(" ")
    return any(head.startswith(lead) or lead.startswith(head) for lead in (CHANNEL, "to=", START))
