"""Tool calls as a grammar, in the chat template's format (`CALL_FORMATS`); the Hermes / Qwen2.5 one

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

as an llguidance Lark grammar whose `arguments` follow each function's JSON schema, for
`StructuredSpec.lark`. The engine applies it as any other structured output (every draft and verify
row masked with its own prefix), so speculation stays lossless and the call is always well formed.

Where the tokenizer has `<tool_call>` / `</tool_call>` as single tokens (Qwen2.5: ids 151657 /
151658; llguidance treats added tokens as special), the grammar names them as tokens (`<tool_call>`
in Lark): free text can then never contain them, so "text, then a call" needs no lookahead. Without
them the tags are plain text, and a lazy rule ends the free text at the first `<tool_call>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdec.structured import JSON_OPTIONS

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# Qwen2.5-Coder's habit: a call written as a ```json block instead of <tool_call> (llama.cpp's
# Hermes parser takes it too). An answer that opens so is a call, constrained as the tagged form
# but with the model's own whitespace.
FENCED_CALL = r'```(?:json)?\s*\{\s*"name"\s*:'


@dataclass(frozen=True)
class ToolGrammarSpec:
    """What the answer may hold. `functions`: (name, parameters JSON schema or None) of the tools a
    call may name; `free_text`: text may come instead of (or before) the calls (`tool_choice="auto"`),
    else the answer is calls only (`"required"` or a named function); `parallel`: several calls, one
    after another, else exactly one; `tag_tokens`: `<tool_call>` and `</tool_call>` are tokens."""

    functions: tuple[tuple[str, str], ...]  # (name, parameters as JSON text)
    free_text: bool
    parallel: bool = True
    tag_tokens: bool = True
    call_format: str = "hermes"  # one of CALL_FORMATS
    tag_id: int | None = None  # mistral: the id of the `[TOOL_CALLS]` token, where the vocabulary has one

    @classmethod
    def build(cls, functions: Sequence[tuple[str, dict[str, Any] | None]], *, free_text: bool,
              parallel: bool = True, tag_tokens: bool = True, call_format: str = "hermes",
              tag_id: int | None = None) -> "ToolGrammarSpec":
        if not functions:
            raise ValueError("a tool grammar needs at least one function")
        if call_format not in CALL_FORMATS:
            raise ValueError(f"unknown tool call format {call_format!r}; one of {', '.join(CALL_FORMATS)}")
        named = tuple((name, json.dumps(_NO_PARAMETERS if params is None else params)) for name, params in functions)
        return cls(named, free_text, parallel, tag_tokens, call_format, tag_id)


# Tool call formats (vLLM's parser names):
#   hermes       <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (Qwen2.5, Qwen3, Hermes)
#   llama3_json  {"name": "f", "parameters": {...}}; {"name": ...}            (Llama 3.1-3.3's custom tools)
#   mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]         (Mistral v0.3 and later JSON lists)
#   qwen3_coder  <tool_call>\n<function=f>\n<parameter=k>\nvalue\n</parameter>\n</function>\n</tool_call>
#   harmony      <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>  (gpt-oss)
CALL_FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "harmony")
MISTRAL_TAG = "[TOOL_CALLS]"


def tool_call_grammar(spec: ToolGrammarSpec) -> str:
    """The Lark grammar of `spec`, in its call format."""
    if spec.call_format in ("hermes", "qwen3_coder"):
        return _hermes_grammar(spec)
    if spec.call_format == "harmony":
        return _harmony_grammar(spec)
    key = "parameters" if spec.call_format == "llama3_json" else "arguments"
    if spec.call_format == "llama3_json":  # calls only at the answer's start: text may not open with "{"
        calls = 'fn ("; " fn)*' if spec.parallel else "fn"
        lines, lead = [f"calls: {calls}"], r"\s*\{"
    else:
        tag = f"<[{spec.tag_id}]>" if spec.tag_id is not None else json.dumps(MISTRAL_TAG)
        more = ' (", " fn)*' if spec.parallel else ""
        lines, lead = [f'calls: {tag} "[" fn{more} "]"'], r"\s*(\[TOOL_CALLS\]|\[\s*\{)"
    start = "start: TEXT | calls" if spec.free_text else "start: calls"
    if spec.free_text:
        lines.append(f"TEXT: /(.|\\n)*/ & ~/{lead}(.|\\n)*/")
    return "%llguidance {}\n" + "\n".join([start, *lines, *_functions(spec, key)]) + "\n"


def _functions(spec: ToolGrammarSpec, key: str) -> list[str]:
    """`fn`: one of the functions as a JSON object, `{"name": ..., key: arguments}`, compact."""
    lines = ["fn: " + " | ".join(f"fn_{i}" for i in range(len(spec.functions)))]
    for i, (name, params) in enumerate(spec.functions):
        header = json.dumps(f'{{"name": {json.dumps(name)}, "{key}": ')
        schema = json.loads(params)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": JSON_OPTIONS}  # compact, as response_format
        lines.append(f'fn_{i}: {header} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    return lines


def _hermes_grammar(spec: ToolGrammarSpec) -> str:
    """The Lark grammar of `spec` in the Hermes format.

    >>> print(tool_call_grammar(ToolGrammarSpec.build([("f", None)], free_text=False, parallel=False)))
    %llguidance {}
    start: <tool_call> body
    body: "\\n" fn "\\n" </tool_call>
    fn: fn_0
    fn_0: "{\\"name\\": \\"f\\", \\"arguments\\": " args_0 "}"
    args_0: %json {"type": "object", "properties": {}, "additionalProperties": false, "x-guidance": {...}}
    """
    if spec.tag_tokens:
        open_, close = OPEN_TAG, CLOSE_TAG  # special-token references
        head = f"TEXT {open_}"
    else:
        open_, close = json.dumps(OPEN_TAG), json.dumps(CLOSE_TAG)
        head = "head"
    more = f' ("\\n" {open_} body)*' if spec.parallel else ""
    xml = spec.call_format == "qwen3_coder"
    if spec.free_text:
        lines = [f"start: TEXT | {head} body{more}" + ("" if xml else " | fence_open fenced")]
        if not spec.tag_tokens:  # the free text ends at the first "<tool_call>"
            lines.append(f"head[lazy]: TEXT {open_}")
        if xml:
            lines.append("TEXT: /(.|\\n)*/")
        else:
            lines += [f"TEXT: /(.|\\n)*/ & ~/{FENCED_CALL}(.|\\n)*/", f"fence_open[lazy]: /{FENCED_CALL}/"]
            lines += _fenced_calls(spec)
    else:
        lines = [f"start: {open_} body{more}"]
    lines.append(f'body: "\\n" fn "\\n" {close}')
    lines += _xml_functions(spec) if xml else _functions(spec, "arguments")
    return "%llguidance {}\n" + "\n".join(lines) + "\n"


def _harmony_grammar(spec: ToolGrammarSpec) -> str:
    """gpt-oss's harmony answer (the prompt ends with `<|start|>assistant`), its markers special
    tokens (so no text can hold one): with free text, messages on the analysis or commentary channel
    first (`<|channel|>analysis<|message|>...<|end|><|start|>assistant`), then the final answer or one
    call; a forced call is the call alone (as in the other formats, no room to think). A call is
    `<|channel|>commentary to=functions.f <|constrain|>json<|message|>` and its arguments; the answer
    then ends, at `<|call|>` (one of the model's stops). One call a turn: harmony's calls end the turn.

    >>> print(tool_call_grammar(ToolGrammarSpec.build([("f", None)], free_text=False, call_format="harmony")))
    %llguidance {}
    start: call
    call: <|channel|> "commentary to=functions." fn
    fn: fn_0
    fn_0: "f" " " <|constrain|> "json" <|message|> args_0
    args_0: %json {"type": "object", "properties": {}, "additionalProperties": false, "x-guidance": {...}}
    """
    lines = ["start: pre* (final | call)" if spec.free_text else "start: call"]
    if spec.free_text:
        lines += ['pre: <|channel|> ("analysis" | "commentary") <|message|> TEXT <|end|> <|start|> "assistant"',
                  'final: <|channel|> "final" <|message|> TEXT', "TEXT: /(.|\\n)*/"]
    lines += ['call: <|channel|> "commentary to=functions." fn',
              "fn: " + " | ".join(f"fn_{i}" for i in range(len(spec.functions)))]
    for i, (name, params) in enumerate(spec.functions):
        schema = json.loads(params)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        lines.append(f'fn_{i}: {json.dumps(name)} " " <|constrain|> "json" <|message|> args_{i}')
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
    return "%llguidance {}\n" + "\n".join(lines) + "\n"


def _xml_functions(spec: ToolGrammarSpec) -> list[str]:
    """Qwen3-Coder's calls: `<function=f>` then each argument as `<parameter=k>\\nvalue\\n</parameter>`,
    in the schema's property order (the required ones always), a string's value as is, any other's as
    JSON (`%json` of its schema: an integer's, a number's or a boolean's JSON text is the value)."""
    lines = ["fn: " + " | ".join(f"fn_{i}" for i in range(len(spec.functions)))]
    for i, (name, params) in enumerate(spec.functions):
        schema = json.loads(params)
        properties = schema.get("properties") or {} if isinstance(schema, dict) else {}
        required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
        parts = []
        for j, (key, sub) in enumerate(properties.items()):
            rule = f"p_{i}_{j}"
            opening = json.dumps(f"<parameter={key}>" + "\n")
            if _is_string(sub):  # value and closing tag one lazy lexeme: it ends at the first closing tag
                lines.append(f"{rule}: {opening} v_{i}_{j}")
                lines.append(f"v_{i}_{j}[lazy]: {_xml_string(sub)}")
            else:
                lines.append(f'{rule}: {opening} v_{i}_{j} "\\n</parameter>\\n"')
                lines.append(f"v_{i}_{j}: %json {json.dumps({**sub, 'x-guidance': JSON_OPTIONS})}")
            parts.append(rule if key in required else f"{rule}?")
        body = " ".join(parts)
        opening = json.dumps(f"<function={name}>" + "\n")
        lines.append(f'fn_{i}: {opening} {body} "</function>"')
    return lines


def _is_string(schema: Any) -> bool:
    """A plain string (or an enum of strings): written as is. A `pattern` or `format` one is JSON."""
    if not isinstance(schema, dict) or "pattern" in schema or "format" in schema:
        return False
    if "enum" in schema:
        return bool(schema["enum"]) and all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


def _regex_literal(text: str) -> str:
    """`text` matched literally in a `/.../` regex of llguidance's Lark."""
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}/-&~#" else ch for ch in text)


def _xml_string(schema: dict[str, Any]) -> str:
    """A string argument's value and the closing `\\n</parameter>\\n`, as one regex: its enum's
    values, or text within its length bounds."""
    close = r"\n<\/parameter>\n"
    if "enum" in schema:
        return "/(" + "|".join(_regex_literal(v) for v in schema["enum"]) + ")" + close + "/"
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    bound = f"{{{low},{int(high)}}}" if high is not None else (f"{{{low},}}" if low else "*")
    return f"/(.|\\n){bound}{close}/"



def _fenced_calls(spec: ToolGrammarSpec) -> list[str]:
    """The rest of a fenced call, after `{"name":` (any whitespace): a name, the arguments, `}` and
    the closing fence."""
    lines = ["fenced: " + " | ".join(f"fenced_{i}" for i in range(len(spec.functions)))]
    for i, (name, params) in enumerate(spec.functions):
        schema = json.loads(params)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {"whitespace_flexible": True}}
        lines.append(f'fenced_{i}: /\\s*"{name}"\\s*,\\s*"arguments"\\s*:\\s*/ fenced_args_{i} /\\s*\\}}\\s*```/')
        lines.append(f"fenced_args_{i}: %json {json.dumps(schema)}")
    return lines
