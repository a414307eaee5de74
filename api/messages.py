"""Chat messages as a request sends them, and as the chat template sees them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from specdec.api.tools import ToolCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; `name` and `tool_call_id` reach the chat template, which may use them, and so
    do an assistant message's `tool_calls` (their arguments as JSON objects, as templates want them)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an earlier answer's refusal: no effect (templates do not show it)
    reasoning_content: str | None = None  # an earlier answer's reasoning, as returned (Qwen3's template reads it)
    tool_calls: list[ToolCall] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_of_the_assistant(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value:
            raise ValueError("the legacy function_call is not supported; send tool_calls")
        return value

    def as_template_dict(self) -> dict[str, Any]:
        """What a chat template sees: role and plain-text content (and name / tool_call_id /
        reasoning_content / tool_calls if set)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        optional = (("name", self.name), ("tool_call_id", self.tool_call_id),
                    ("reasoning_content", self.reasoning_content))
        message.update({k: v for k, v in optional if v})
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        return message
