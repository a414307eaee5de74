"""What one server holds: its settings, the engine loop, metrics, the concurrency limit, and prompt
tokenization (chat template / text / token ids), all checked before a request reaches the engine."""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from specdec.api.engine_loop import AsyncEngine, EngineInfo
from specdec.api.errors import APIError
from specdec.api.logprobs import TokenTexts
from specdec.api.metrics import ServerMetrics
from specdec.api.reasoning import REASONING_PARSERS, chat_template_text
from specdec.api.schemas import FieldError, RequestBody
from specdec.api.tools import TOOL_CALL_PARSERS, ToolUse, mistral_tag_id, template_call_format, tool_tags_are_tokens
from specdec.sampling_params import StructuredSpec
from specdec.target.tokenizer import encode_prompt

logger = logging.getLogger("specdec.api")
TemplateVariables = Sequence[tuple[str, str, Any]]  # (param, name, value)


@dataclass
class ServerSettings:
    """How the server behaves (the engine's own settings live in EngineConfig)."""

    model_name: str = "specdec"
    api_key: str | None = None
    max_concurrent: int = 64
    max_body_bytes: int = 1 << 20
    ping_seconds: float = 15.0  # SSE keep-alive comments; a failed ping notices a dead client
    send_timeout_seconds: float = 60.0  # a client that stops reading for this long is dropped
    on_load_error: Callable[[str], None] | None = None
    warmup: bool = False  # run specdec.warmup.warm_up before /health turns 200 (`specdec serve` does)
    reasoning_parser: str = "auto"  # specdec.api.reasoning: auto, none, deepseek_r1 or qwen3
    tool_call_parser: str = "auto"  # specdec.api.tools.TOOL_CALL_PARSERS: the chat template's, or one named
    strict_fields: bool = False  # refuse undeclared request fields instead of ignoring them with a warning

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {self.max_concurrent}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")


class ConcurrencyLimiter:
    """Admits at most `limit` requests at once; used from the event loop thread only."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0

    def try_acquire(self, slots: int = 1) -> bool:
        if self.active + slots > self.limit:
            return False
        self.active += slots
        return True

    def release(self, slots: int = 1) -> None:
        assert self.active >= slots, "released more slots than acquired"
        self.active -= slots


class ServerState:
    def __init__(self, settings: ServerSettings, engine: AsyncEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = ServerMetrics(engine)
        self.limiter = ConcurrencyLimiter(settings.max_concurrent)
        self._token_texts: TokenTexts | None = None
        self.stored_responses: OrderedDict[str, Any] = OrderedDict()  # /v1/responses by id (`responses.STORED`)

    def info(self) -> EngineInfo:
        """The loaded engine's facts; 503 while loading or after the engine loop died."""
        if self.engine.error is not None:
            raise APIError(503, f"the engine is not running: {self.engine.error}", code="engine_dead")
        if self.engine.info is None:
            raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "5"})
        return self.engine.info

    def screen_fields(self, request: Request, body: RequestBody) -> None:
        """Refuse `body`'s undeclared fields that would change the answer (and, with
        `strict_fields`, any); let the others pass, logged and named in the response's `Warning`
        header (`IgnoredFieldsHeader`)."""
        try:
            ignored = body.extra_fields(self.settings.strict_fields)
        except FieldError as exc:
            raise APIError(400, str(exc), exc.param, exc.code) from exc
        if ignored:
            logger.warning("%s: ignored fields the server does not know: %s", request.url.path, ", ".join(ignored))
            request.state.ignored_fields = ignored

    def check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}.", "model", "model_not_found")

    @property
    def tokenizer(self) -> Any:
        """The API's own copy of the tokenizer (see `EngineInfo.api_tokenizer`)."""
        return self.info().api_tokenizer

    @property
    def token_texts(self) -> TokenTexts:
        """Token id -> text and bytes for logprob entries (one cache for the server's life)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts

    @property
    def chat_template(self) -> str:
        """The chat template's text; a 400 for a model without one."""
        template = chat_template_text(self.tokenizer)
        if not template:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        return template

    def chat_prompt_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        variables: TemplateVariables = ()) -> list[int]:
        ids = self._render(messages, add_generation_prompt, tools, variables, tokenize=True)
        return self._checked(list(ids), "messages")

    def chat_prompt_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                         variables: TemplateVariables = ()) -> str:
        """The prompt as the template writes it (does it leave a `<think>` open?)."""
        return self._render(messages, True, tools, variables, tokenize=False)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, variables: TemplateVariables, tokenize: bool) -> Any:
        """The template applied; `variables` (`ChatCompletionRequest.template_variables`): each must be
        one the template mentions, else a 400 naming the field that set it (a variable the template
        never reads would silently change nothing)."""
        template = self.chat_template
        if "message.thinking" in template:  # gpt-oss's reads an earlier answer's reasoning as `thinking`
            messages = [_with_thinking(m) for m in messages]
        for param, name, _ in variables:
            if not re.search(rf"\b{name}\b", template):
                raise APIError(400, f"this model's chat template does not use {name!r}", param, "invalid_value")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize,
                return_dict=False, **{name: value for _, name, value in variables},
            )
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's
            raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from exc

    @property
    def tool_call_format(self) -> str | None:
        """The format tool calls are written and parsed in: `--tool-call-parser`, or the one the
        chat template writes (None: it offers no tools specdec can parse)."""
        if self.settings.tool_call_parser != "auto":
            return self.settings.tool_call_parser
        tokenizer = self.tokenizer
        return None if tokenizer is None else template_call_format(tokenizer)

    def tool_grammar(self, tool_use: ToolUse) -> StructuredSpec | None:
        """The grammar of an answer with tools (None without): calls in the chat template's format."""
        if not tool_use.active:
            return None
        call_format = self.tool_call_format
        if call_format is None:
            raise APIError(400, "this model's chat template does not offer tools in a format specdec parses "
                           "(Hermes / Qwen <tool_call>, Qwen3-Coder XML, Mistral [TOOL_CALLS], Llama 3.1 JSON, gpt-oss harmony); "
                           "--tool-call-parser names one", "tools", "invalid_value")
        tokenizer = self.tokenizer
        return tool_use.structured(tool_tags_are_tokens(tokenizer), call_format,
                                   mistral_tag_id(tokenizer) if call_format == "mistral" else None)

    def completion_prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion's prompt as ids: token ids as sent, text led by the model's BOS where its
        tokenizer adds one (`encode_prompt`)."""
        if isinstance(prompt, str):
            prompt = encode_prompt(self.require_tokenizer("send the prompt as token ids", "prompt"), prompt)
        return self._checked(list(prompt), "prompt")

    def prompt_text(self, prompt: str | list[int], prompt_ids: list[int]) -> str:
        """The prompt as text (`echo`): as sent, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return self.require_tokenizer("echo needs the prompt as text", "echo").decode(prompt_ids)

    def require_tokenizer(self, advice: str, param: str) -> Any:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError(400, f"this model has no tokenizer; {advice}", param)
        return tokenizer

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        return self.checked_token_ids(ids, param)

    def checked_token_ids(self, ids: list[int], param: str) -> list[int]:
        """`ids`, or a 400 naming `param` if one is not in the vocabulary."""
        vocab = self.info().vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"token ids must be in [0, {vocab})", param, "invalid_token_id")
        return ids


def server_state(request: Request) -> ServerState:
    return request.app.state.specdec


def _with_thinking(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's `reasoning_content` also as `thinking` (transformers >= 5.x aliases it
    too), but none beside both content and calls: gpt-oss's template refuses reasoning there
    (content before a call, a preamble, is the message's analysis already)."""
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if not reasoning:
        return message
    if message.get("content") and message.get("tool_calls"):
        return {k: v for k, v in message.items() if k not in ("reasoning_content", "thinking")}
    return {**message, "thinking": reasoning}
