"""Tool calling, request side: `tools`, `tool_choice`, `parallel_tool_calls` and the assistant's
earlier `tool_calls`, as OpenAI defines them, for chat templates that write calls in the Hermes /
Qwen `<tool_call>` format, Qwen3-Coder's XML calls, Mistral's `[TOOL_CALLS]` list, Llama 3.1's JSON
or gpt-oss's harmony messages (`template_call_format`, or `specdec serve --tool-call-parser`).

- `tool_choice="none"`: the tools are left out of the prompt (the model cannot see them, so it
  answers in text; OpenAI lists them and forbids calls) and the answer is not parsed;
- `"auto"` (the default when tools are given): the tools are in the prompt; the answer is free text
  or calls, and a call's arguments are constrained by its function's schema
  (`specdec.tool_grammar`, `free_text=True`), so every call the server returns validates;
- `"required"` / `{"type": "function", "function": {"name": ...}}`: the answer is calls only, to
  any tool / to that one, arguments constrained;
- `parallel_tool_calls=false`, or a named function: exactly one call, then the answer ends (the
  grammar allows nothing but the end after `</tool_call>`); otherwise several calls may follow
  one another, and the end is allowed after each.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specdec.sampling_params import StructuredSpec
from specdec.tool_grammar import CALL_FORMATS, CLOSE_TAG, MISTRAL_TAG, OPEN_TAG, ToolGrammarSpec, tool_call_grammar

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: bool | None = None  # calls always follow `parameters` (they are constrained)


class ToolDefinition(BaseModel):
    """One entry of `tools`: a function the model may call."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """What the chat template lists (no `strict`: it is ours, not the model's)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True, exclude={"strict"})}


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice={"type": "function", "function": {"name": ...}}`: call this function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as the server returned it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"arguments must be a JSON object (as text): {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object (as text)")
        return arguments


class ToolCall(BaseModel):
    """One call of an earlier assistant message, sent back with the conversation."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        # Qwen2.5's template (as Hermes') writes `arguments | tojson`: it wants the object itself
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


def check_tools(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [tool.function.name for tool in tools or []]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"function names must be unique; repeated: {', '.join(duplicates)}")
    return tools


def check_tool_choice(choice: ToolChoice | None, tools: list[ToolDefinition] | None) -> ToolChoice | None:
    if choice in (None, "none"):
        return choice
    if not tools:
        raise ValueError("tool_choice needs tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise ValueError(f"{choice.function.name!r} is not one of the tools' functions")
    return choice


class ToolUse:
    """A chat request's tool settings, resolved: what the template lists, whether the answer is
    parsed for calls, and the grammar that constrains them."""

    def __init__(self, tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool | None) -> None:
        self.tools = list(tools or [])
        self.choice = choice if choice is not None else ("auto" if self.tools else "none")
        self.parallel = parallel is not False

    @property
    def active(self) -> bool:
        """Tools are offered and calls are parsed from the answer."""
        return bool(self.tools) and self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.template_dict() for tool in self.tools] if self.active else None

    def callable_tools(self) -> list[ToolDefinition]:
        if isinstance(self.choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.choice.function.name]
        return self.tools

    def structured(self, tag_tokens: bool, call_format: str = "hermes", tag_id: int | None = None) -> StructuredSpec | None:
        """The grammar of the answer (None when no tools are active), calls in `call_format`."""
        if not self.active:
            return None
        named = isinstance(self.choice, NamedToolChoice)  # OpenAI: one call of that function
        spec = ToolGrammarSpec.build([(t.function.name, t.function.parameters) for t in self.callable_tools()],
                                     free_text=self.choice == "auto", parallel=self.parallel and not named,
                                     tag_tokens=tag_tokens, call_format=call_format, tag_id=tag_id)
        return StructuredSpec.lark(tool_call_grammar(spec))


def tool_tags_are_tokens(tokenizer: Any) -> bool:
    """`<tool_call>` and `</tool_call>` are single tokens of this vocabulary (Qwen2.5: yes)."""
    added = tokenizer.get_added_vocab()
    return OPEN_TAG in added and CLOSE_TAG in added


TOOL_CALL_PARSERS = ("auto",) + CALL_FORMATS


def template_call_format(tokenizer: Any) -> str | None:
    """The call format the chat template writes (`specdec.tool_grammar.CALL_FORMATS`), None if
    none: `<|channel|>` and `<|call|>` (gpt-oss's harmony), `<tool_call>` with `<function=` in it (Qwen3-Coder's XML), `<tool_call>` (Hermes, Qwen2.5 /
    Qwen3), `[TOOL_CALLS]` (Mistral), Llama 3.1's
    `{"name": ..., "parameters": ...}` (its template names `"parameters"`, or `<|python_tag|>`)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "".join(template.values())
    if "tools" not in template:
        return None
    if "<|channel|>" in template and "<|call|>" in template:
        return "harmony"
    if "<function=" in template and OPEN_TAG in template:
        return "qwen3_coder"
    if OPEN_TAG in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if '"parameters": ' in template or "<|python_tag|>" in template:
        return "llama3_json"
    return None


def mistral_tag_id(tokenizer: Any) -> int | None:
    """The id of `[TOOL_CALLS]` where it is one token of the vocabulary (Mistral's: a control token)."""
    ids = tokenizer.encode(MISTRAL_TAG, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
