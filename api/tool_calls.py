"""Tool calls, answer side: `<tool_call>` blocks parsed out of the generated text, as it streams
or whole (a whole answer is parsed by the same streaming parser, so the two agree).

Streamed as OpenAI streams them: text before a call as `content` deltas; a call's first delta once
its name is known (`index`, `id`, `type`, `function.name`, `function.arguments: ""`), then its
arguments in pieces as they are generated. `function.arguments` is the model's own JSON text of
the arguments (compact, in the schema's property order when the call was constrained).

Text that may still turn into a tag (`<tool_c...`) and whitespace before a call are held back;
whitespace next to a call is dropped. An answer that opens with a ```json block holding
`{"name": ..., "arguments": ...}` is a call too (Qwen2.5-Coder's habit; `specdec.tool_grammar`
constrains it in `auto` mode); its `arguments` keep the model's whitespace. A call whose JSON does not parse (only possible without a
constraint) is returned as content; a call cut off by max_tokens is not (`ToolCallParser.finish`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import regex  # transformers' dependency: partial matches (may this text still become a fence?)

from specdec.tool_grammar import CLOSE_TAG, FENCED_CALL, OPEN_TAG

FENCE = "```"
_FENCED_CALL = regex.compile(FENCED_CALL)  # at the answer's start (the grammar's pattern)
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def new_call_id(call_format: str = "hermes") -> str:
    """OpenAI's `call_...`; Mistral's templates want nine letters and digits."""
    if call_format == "mistral":
        return uuid.uuid4().hex[:9]
    return f"call_{uuid.uuid4().hex[:24]}"


def tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Feeds on text pieces, yields `Event`s.

    >>> p = ToolCallParser()
    >>> p.feed('Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>') + p.finish()
    [ContentDelta(text='Sure.'), CallStart(index=0, id='call_...', name='f'), ArgumentsDelta(index=0, text='{"x": 1}')]
    """

    def __init__(self) -> None:
        self._text = ""  # text mode: held back
        self._body: str | None = None  # call mode: the text after <tool_call>
        self._args_at: int | None = None  # where the arguments start in _body, once the name is known
        self._sent = 0  # argument characters sent
        self._after_call = False
        self._at_start = True  # nothing decided yet: the answer may open a fenced call
        self._open, self._close = OPEN_TAG, CLOSE_TAG  # the current call's delimiters
        self.num_calls = 0  # calls started
        self.num_complete = 0
        self.truncated_call: str | None = None  # set by finish(): an unfinished call's text

    def feed(self, piece: str) -> list[Event]:
        events: list[Event] = []
        if self._body is None:
            self._text += piece
        else:
            self._body += piece
        while True:
            if self._body is None and not self._scan_text(events):
                return events
            if self._body is not None and not self._scan_call(events):
                return events

    def finish(self) -> list[Event]:
        """The held-back text. An unfinished call (cut off by max_tokens) is never content: its
        text is kept in `truncated_call`, and a stream has sent its name and arguments so far only
        if its name was out (OpenAI's "length" with a partial call)."""
        events: list[Event] = []
        if self._body is None:
            text = self._text.lstrip() if self._after_call else self._text
            if text:
                events.append(ContentDelta(text))
        else:
            self.truncated_call = self._open + self._body
        self._text, self._body = "", None
        return events

    def _scan_text(self, events: list[Event]) -> bool:
        """Emit what is surely content; True if a call starts."""
        if self._at_start:
            fence = _FENCED_CALL.match(self._text, partial=True)
            if fence is not None and fence.partial:
                return False  # wait: this may open a fenced call
            self._at_start = False
            if fence is not None:
                brace = self._text.index("{")
                self._open, self._close = self._text[:brace], FENCE
                self._body, self._text, self._args_at, self._sent = self._text[brace:], "", None, 0
                return True
        at = self._text.find(OPEN_TAG)
        end = at if at >= 0 else len(self._text) - tag_prefix_len(self._text, OPEN_TAG)
        head = self._text[:end]
        keep = len(head.rstrip())
        if self._after_call:
            head = head.lstrip()
            keep = len(head.rstrip())
            self._after_call = bool(not head)
        if keep:
            events.append(ContentDelta(head[:keep]))
        if at < 0:
            self._text = head[keep:] + self._text[end:]
            return False
        self._body, self._text = self._text[at + len(OPEN_TAG):], ""
        self._open, self._close, self._args_at, self._sent = OPEN_TAG, CLOSE_TAG, None, 0
        return True

    def _scan_call(self, events: list[Event]) -> bool:
        """Emit the call's start and arguments so far; True if the call closed (text follows)."""
        body = self._body
        if self._args_at is None:
            header = _HEADER.match(body)
            if header:
                self._args_at = header.end()
                events.append(CallStart(self.num_calls, new_call_id(), json.loads(f'"{header.group(1)}"')))
                self.num_calls += 1
        close = body.find(self._close)
        if close < 0:
            if self._args_at is not None:
                self._send_arguments(events, body[self._args_at:], final=False)
            return False
        self._close_call(events, body[:close])
        self._body, self._text, self._after_call = None, body[close + len(self._close):], True
        return True

    def _send_arguments(self, events: list[Event], args: str, final: bool) -> None:
        """Send `args` up to what may still be the call's closing `}` (and the tag after it)."""
        cut = len(args)
        brace = args.rfind("}")
        rest = args[brace + 1:].lstrip() if brace >= 0 else None
        if rest is not None and (final or self._close.startswith(rest)):
            cut = brace
        cut = len(args[:cut].rstrip())
        if cut > self._sent:
            events.append(ArgumentsDelta(self.num_calls - 1, args[self._sent:cut]))
            self._sent = cut

    def _close_call(self, events: list[Event], body: str) -> None:
        if self._args_at is not None:
            self._send_arguments(events, body.rstrip()[self._args_at:], final=True)
            self.num_complete += 1
            return
        try:  # not in our format (keys in another order, spaces): the whole call, if it parses
            call = json.loads(body)
            name, arguments = call["name"], call["arguments"]
            assert isinstance(name, str) and isinstance(arguments, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            events.append(ContentDelta(self._open + body + self._close))
            return
        events.append(CallStart(self.num_calls, new_call_id(), name))
        events.append(ArgumentsDelta(self.num_calls, json.dumps(arguments, ensure_ascii=False)))
        self.num_calls += 1
        self.num_complete += 1


_DECODER = json.JSONDecoder()
# how an answer opens its calls (the grammar keeps text from opening so)
_LEADS = {"llama3_json": regex.compile(r"\s*(<\|python_tag\|>)?(?=\{)|\s*<\|python_tag\|>"),
          "mistral": regex.compile(r"\s*(\[TOOL_CALLS\])?(?=\[\s*\{)|\s*\[TOOL_CALLS\]")}


class JsonCallsParser:
    """The parser of the formats whose calls are bare JSON objects at the answer's start
    (`llama3_json`: `{"name": "f", "parameters": {...}}; {...}`, an optional `<|python_tag|>`
    first; `mistral`: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, the tag invisible
    where it is a special token). Same events and fields as `ToolCallParser`. An answer that opens
    otherwise is content, all of it (the grammar allows calls only at the start). A call's events
    come once its object is whole (its arguments in one piece, as `json.dumps` writes them: the
    constrained text's own spacing); text after the calls is dropped, as vLLM's parsers drop it.

    >>> p = JsonCallsParser("llama3_json")
    >>> p.feed('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "par') + p.feed('ameters": {}}') + p.finish()
    [CallStart(index=0, id='call_...', name='f'), ArgumentsDelta(index=0, text='{"x": 1}'), CallStart(index=1, id='call_...', name='g'), ArgumentsDelta(index=1, text='{}')]
    """

    def __init__(self, call_format: str) -> None:
        self.format = call_format
        self._lead = _LEADS[call_format]
        self._text = ""
        self._mode: str | None = None  # None: undecided, "text", "calls"
        self._at = 0  # calls mode: where the next call (or separator) starts
        self.num_calls = self.num_complete = 0
        self.truncated_call: str | None = None

    def feed(self, text: str) -> list[Event]:
        self._text += text
        if self._mode is None:
            lead = self._lead.match(self._text, partial=True)
            if lead is not None and (lead.partial or not self._text.strip()):
                return []  # may still open a call
            self._mode = "calls" if lead is not None else "text"
            self._at = lead.end() if lead is not None else 0
        if self._mode == "text":
            out, self._text = self._text, ""
            return [ContentDelta(out)] if out else []
        return self._calls()

    def finish(self) -> list[Event]:
        events = self._calls() if self._mode == "calls" else []
        rest = self._text[self._at:].strip(" \n\t;,]") if self._mode == "calls" else self._text
        if self._mode == "calls" and rest:
            self.truncated_call = rest  # an object never closed
        elif self._mode is None and rest:
            events.append(ContentDelta(rest))
        self._text, self._at = "", 0
        return events

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while True:
            at = self._at
            while at < len(self._text) and self._text[at] in " \n\t;,[":
                at += 1
            try:
                call, end = _DECODER.raw_decode(self._text, at)
            except ValueError:
                return events  # not whole yet
            self._at = end
            arguments = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
            if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(arguments, dict)):
                continue  # not a call (only without a constraint): dropped
            events.append(CallStart(self.num_calls, new_call_id(self.format), call["name"]))
            events.append(ArgumentsDelta(self.num_calls, json.dumps(arguments, ensure_ascii=False)))
            self.num_calls += 1
            self.num_complete += 1


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n(.*?)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n?", re.DOTALL)


class XmlCallParser(ToolCallParser):
    """Qwen3-Coder's calls, in `<tool_call>` blocks as Hermes': `<function=f>` and one
    `<parameter=k>\\nvalue\\n</parameter>` per argument. A value is the argument's text where its
    schema (`schemas`: function name -> parameters) says string, else JSON (text if it does not
    parse); `arguments` is their JSON object. A call's events come once its block closed.

    >>> p = XmlCallParser({"f": {"properties": {"city": {"type": "string"}, "n": {"type": "integer"}}}})
    >>> p.feed("<tool_call>\\n<function=f>\\n<parameter=city>\\n42\\n</parameter>\\n") + p.feed(
    ...     "<parameter=n>\\n42\\n</parameter>\\n</function>\\n</tool_call>") + p.finish()
    [CallStart(index=0, id='call_...', name='f'), ArgumentsDelta(index=0, text='{"city": "42", "n": 42}')]
    """

    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._at_start = False  # no fenced JSON calls in this format
        self._schemas = schemas or {}

    def _scan_call(self, events: list[Event]) -> bool:
        close = self._body.find(CLOSE_TAG)
        if close < 0:
            return False
        body, self._text, self._after_call = self._body[:close], self._body[close + len(CLOSE_TAG):], True
        self._body = None
        function = _XML_FUNCTION.fullmatch(body)
        if function is None:  # not in this format (only without a constraint): the text as it was
            events.append(ContentDelta(OPEN_TAG + body + CLOSE_TAG))
            return True
        name = function.group(1)
        properties = (self._schemas.get(name) or {}).get("properties") or {}
        arguments = {key: _xml_argument(value, properties.get(key))
                     for key, value in _XML_PARAMETER.findall(function.group(2))}
        events.append(CallStart(self.num_calls, new_call_id(), name))
        events.append(ArgumentsDelta(self.num_calls, json.dumps(arguments, ensure_ascii=False)))
        self.num_calls += 1
        self.num_complete += 1
        return True


def _xml_argument(value: str, schema: Any) -> Any:
    strings = isinstance(schema, dict) and (schema.get("type") == "string" or (
        bool(schema.get("enum")) and all(isinstance(v, str) for v in schema["enum"])))
    if strings:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def tool_call_parser(call_format: str = "hermes",
                     schemas: dict[str, Any] | None = None) -> ToolCallParser | JsonCallsParser | XmlCallParser:
    """The parser of `call_format`'s calls (`schemas`: each function's parameters, which Qwen3-Coder's
    untyped values are read by). gpt-oss's harmony answers are read whole, reasoning and calls
    together, by `specdec.api.harmony.HarmonyParser`."""
    if call_format == "hermes":
        return ToolCallParser()
    if call_format == "harmony":
        raise ValueError("harmony answers are read by specdec.api.harmony.HarmonyParser")
    if call_format == "qwen3_coder":
        return XmlCallParser(schemas)
    return JsonCallsParser(call_format)


def split_tool_calls(text: str, call_format: str = "hermes", schemas: dict[str, Any] | None = None,
                     parser: Any = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content or None, tool_calls as OpenAI returns them) of a whole answer: the complete calls
    only; an unfinished one (cut off by max_tokens) is in neither. `parser`: one to read it with
    instead of `call_format`'s (a `HarmonyParser`)."""
    parser = parser if parser is not None else tool_call_parser(call_format, schemas)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ArgumentsDelta):
            calls[event.index]["function"]["arguments"] += event.text
    if parser.truncated_call is not None and len(calls) > parser.num_complete:
        calls.pop()  # its name was out: started, never finished
    return content or None, calls


def stream_delta(event: Event) -> dict[str, Any]:
    """A chat chunk's `delta` for one event."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def finish_reason(reason: str, parser: ToolCallParser) -> str:
    """`tool_calls` when the answer ended on its own after at least one whole call."""
    return "tool_calls" if reason == "stop" and parser.num_complete else reason
