"""Request bodies of the OpenAI-compatible endpoints (pydantic), validated before any work is done.

Every declared field either changes the answer as OpenAI (or vLLM, for its extensions) defines it, or is
refused with a 400 that names it. A few OpenAI fields cannot change the answer (`user`, `metadata`,
`store`, `service_tier`, ...); they are accepted and not used. A top-level field not declared here
(`RequestBody`) is answered as vLLM answers it: accepted, named in a `Warning` header and a log
line; `specdec serve --strict-fields` refuses it instead (OpenAI's `unknown_parameter`). Fields
other servers honour that would change the answer here (`UNSUPPORTED_FIELDS`: vLLM's guided
decoding, beam search, llama-server's samplers, ...) are refused by name either way, so a control
this server does not have never silently leaves the answer unchanged. Inside messages, tools and
other objects, unknown keys are refused. docs/serving.md lists every field;
tests/api/test_request_fields.py walks these models against that list.
`top_k`, `ignore_eos` and `num_speculative_tokens` are specdec extensions; `min_p`, `min_tokens`,
`repetition_penalty`, `stop_token_ids` and `cache_salt` are vLLM's (pass them with the openai
client's `extra_body`), and so is `response_format` on completions.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from specdec.api.messages import ChatMessage, TextPart  # noqa: F401 - TextPart: part of this module's API
from specdec.api.tools import ToolChoice, ToolDefinition, ToolUse, check_tool_choice, check_tools
from specdec.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, StructuredSpec

_FLOAT = dict(allow_inf_nan=False)
MAX_N = 16  # choices per request
# what the request itself sets when the chat template renders (apply_chat_template's arguments)
_TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class FieldError(ValueError):
    """A field's value that only the loaded model can refuse (token ids past its vocabulary,
    `min_tokens` over the room left): a 400 naming `param`."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.code = param, code


_GUIDED = "send response_format (json_schema), or tools"
# Fields that other servers honour and that would change the answer: refused by name, with the reason.
UNSUPPORTED_FIELDS = {
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                     "guided_whitespace_pattern", "structured_outputs", "grammar", "json_schema"), _GUIDED),
    **dict.fromkeys(("use_beam_search", "length_penalty", "early_stopping"), "beam search is not supported"),
    **dict.fromkeys(("typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "dry_multiplier",
                     "dry_base", "dry_allowed_length", "dry_penalty_last_n", "xtc_probability", "xtc_threshold",
                     "top_n_sigma", "samplers", "penalty_last_n", "repeat_last_n", "dynatemp_range"),
                    "this sampler is not supported (temperature, top_p, top_k, min_p and the penalties are)"),
    **dict.fromkeys(("bad_words", "allowed_token_ids", "logits_processors"),
                    "token restrictions are not supported; send logit_bias"),
    **dict.fromkeys(("truncate_prompt_tokens", "add_special_tokens", "add_generation_prompt",
                     "continue_final_message", "chat_template", "documents", "mm_processor_kwargs"),
                    "the prompt is rendered by the model's own chat template as sent"),
    **dict.fromkeys(("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "return_tokens_as_token_ids", "n_probs"), "the answer's text is given as the tokenizer decodes it"),
    **dict.fromkeys(("audio", "modalities", "prediction", "web_search_options", "verbosity"),
                    "this OpenAI feature is not supported"),
    "priority": "requests are served first come, first served",
    "n_predict": "send max_tokens",
}


class RequestBody(BaseModel):
    """A request's top level. Fields it does not declare are kept (`model_extra`) for
    `extra_fields` to refuse or let pass with a warning."""

    model_config = ConfigDict(extra="allow")

    def extra_fields(self, strict: bool) -> list[str]:
        """The undeclared fields this request sent, which leave the answer unchanged; raises
        FieldError for one of `UNSUPPORTED_FIELDS` (or any, with `strict`)."""
        extra = sorted(self.model_extra or {})
        for name in extra:
            if name in UNSUPPORTED_FIELDS:
                raise FieldError(name, f"not supported: {UNSUPPORTED_FIELDS[name]}", "unsupported_parameter")
        if strict and extra:
            raise FieldError(extra[0], "unrecognized request argument (this server refuses unknown fields: "
                             "--strict-fields)", "unknown_parameter")
        return extra


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer, as OpenAI sends it."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "invalid JSON or parameters, an unknown or unsupported field (named in `param`), or "
              "prompt + max_tokens over the context length"),
        (401, "missing or wrong API key (when the server has one)"),
        (404, "unknown model"),
        (413, "request body too large"),
        (429, "--max-concurrent requests are already running"),
        (500, "the engine failed while generating this request"),
        (503, "the model is loading, or the engine stopped"),
    )
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI defines it. The answer always follows `schema`
    exactly (`strict` true or not: a constrained answer cannot stray from it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatField(BaseModel):
    """`response_format`: `text` (the default), `json_object` (any JSON object) or `json_schema`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormatField":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only with it")
        return self

    def structured(self) -> StructuredSpec | None:
        if self.type == "json_object":
            return StructuredSpec.json_object()
        if self.type == "json_schema":
            return StructuredSpec.json_schema(self.json_schema.schema_ or {})
        return None


class GenerationFields(RequestBody):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, **_FLOAT)
    top_p: float | None = Field(None, gt=0.0, le=1.0, **_FLOAT)
    n: int | None = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, **_FLOAT)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, **_FLOAT)
    logit_bias: dict[str, float] | None = Field(None, description="token id (a decimal string) -> bias in [-100, 100]")
    user: str | None = None  # no effect on the answer
    # vLLM extensions
    min_p: float | None = Field(None, ge=0.0, le=1.0, **_FLOAT)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, **_FLOAT)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # vLLM extension: requests with different salts share no cached prompt prefix
    cache_salt: str | None = None
    # specdec extensions
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # any k >= vocab size means off
    ignore_eos: bool | None = False
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    # structured output (OpenAI's on chat; vLLM's on completions)
    response_format: ResponseFormatField | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string when given")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if len(bias or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(bias)}")
        for key, value in (bias or {}).items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None = off, N = the token's logprob and N alternatives."""
        return None

    def sampling_params(self, max_tokens: int, vocab_size: int,
                        tool_grammar: StructuredSpec | None = None) -> SamplingParams:
        """The engine's parameters for this request (`tool_grammar`: the tool calls' grammar, which
        takes the place of `response_format`). Raises FieldError naming the field."""
        for name, ids in (("logit_bias", [int(k) for k in self.logit_bias or {}]),
                          ("stop_token_ids", self.stop_token_ids or [])):
            if any(i >= vocab_size for i in ids):
                raise FieldError(name, f"token ids must be below the vocabulary size {vocab_size}")
        if (self.min_tokens or 0) > max_tokens:
            raise FieldError("min_tokens", f"{self.min_tokens} is more than max_tokens ({max_tokens})")
        structured = self.response_format.structured() if self.response_format is not None else None
        if structured is not None and tool_grammar is not None:
            raise FieldError("response_format", "cannot be combined with tools (unless tool_choice is 'none')")
        structured, param = (tool_grammar, "tool_choice") if tool_grammar is not None else (structured, "response_format")
        if structured is not None and (self.ignore_eos or self.min_tokens):
            raise FieldError(param, "cannot be combined with ignore_eos or min_tokens: the "
                             "grammar decides where the answer ends")
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=self.requested_logprobs(),
            structured=structured,
        )


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # no effect on the answer
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # tool calling (specdec.api.tools)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # refused: the legacy form of tools
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # chat template variables (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking), each
    # refused unless the template uses it (`ServerState.chat_prompt_ids`)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        return check_tools(tools)

    @field_validator("tool_choice")
    @classmethod
    def _known_tool(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        return check_tool_choice(choice, info.data.get("tools"))

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("the legacy functions field is not supported; send tools")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: str | dict | None) -> str | dict | None:
        if value not in (None, "none"):
            raise ValueError("the legacy function_call field is not supported; send tool_choice")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        odd = sorted(k for k in kwargs or {} if not k.isidentifier())
        if odd:
            raise ValueError(f"template variable names are identifiers, got {', '.join(map(repr, odd))}")
        taken = sorted(set(kwargs or {}) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by the request itself, not a chat template variable")
        return kwargs

    def template_variables(self) -> list[tuple[str, str, Any]]:
        """(the field that sets it, name, value) of each chat template variable besides messages and
        tools: `("chat_template_kwargs.enable_thinking", "enable_thinking", False)`, `reasoning_effort`."""
        variables = [(f"chat_template_kwargs.{k}", k, v) for k, v in (self.chat_template_kwargs or {}).items()]
        if self.reasoning_effort is not None:
            variables.append(("reasoning_effort", "reasoning_effort", self.reasoning_effort))
        return variables

    @property
    def tool_use(self) -> ToolUse:
        return ToolUse(self.tools, self.tool_choice, self.parallel_tool_calls)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationFields):
    """POST /v1/completions. One prompt per request: text, or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _prompt_scoring(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo (and logprobs, for the prompt's)")
        if self.stream and (self.scores_prompt or self.max_tokens == 0):
            raise ValueError(f"{'echo with logprobs' if self.echo else 'prompt_logprobs'} is answered whole "
                             "(the prompt's logprobs): send stream false")
        return self

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """SamplingParams.prompt_logprobs: `echo` with `logprobs`, or vLLM's `prompt_logprobs`."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs_wanted is not None

    def requested_max_tokens(self) -> int | None:
        return 1 if self.max_tokens == 0 else self.max_tokens  # 0: one token run, none answered

    def sampling_params(self, max_tokens: int, vocab_size: int,
                        tool_grammar: StructuredSpec | None = None) -> SamplingParams:
        params = super().sampling_params(max_tokens, vocab_size, tool_grammar)
        return dataclasses.replace(params, prompt_logprobs=self.prompt_logprobs_wanted)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            raise ValueError(f"best_of must equal n ({n}): choosing the best of several samples "
                             "is not supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def requested_logprobs(self) -> int | None:
        return self.logprobs
