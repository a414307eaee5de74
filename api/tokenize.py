"""POST /tokenize and POST /detokenize, as vLLM serves them (at the root, beside /health; public
like vLLM's, since they run no model):

    POST /tokenize   {"prompt": "def f():"}                          -> {"count": 4, "max_model_len": 32768,
                     {"messages": [...], "add_generation_prompt": true}    "tokens": [...], "token_strs": null}
    POST /detokenize {"tokens": [755, 282, 4555]}                    -> {"prompt": "def f():"}

A prompt is tokenized as /v1/completions tokenizes one (led by the model's BOS where its
tokenizer adds one: Gemma, Llama; `add_special_tokens` true / false: the tokenizer's own
specials / none), so `count` is what a completion request's `usage.prompt_tokens` will say;
messages go through the chat template exactly as /v1/chat/completions sends them. `return_token_strs` adds the tokenizer's
own token strings. `model` is optional; when given it must be the served model.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specdec.api.errors import APIError
from specdec.api.schemas import ERROR_RESPONSES, ChatMessage
from specdec.api.state import ServerState, server_state
from specdec.api.tools import ToolDefinition
from specdec.target.tokenizer import encode_prompt

router = APIRouter()


class TokenizeRequest(BaseModel):
    """A prompt (text) or chat messages, exactly one of them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = None  # listed by the template, as a chat request with tools does
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools apply to messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


@router.post("/tokenize", tags=["vllm"], responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _checked_state(request, body.model)
    if body.messages is not None:
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens applies to a prompt; the chat template places the "
                           "special tokens of messages", "add_special_tokens")
        messages = [m.as_template_dict() for m in body.messages]
        tools = [tool.template_dict() for tool in body.tools] if body.tools else None
        ids = state.chat_prompt_ids(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                    tools=tools)
    else:
        if body.add_generation_prompt is not None:
            raise APIError(400, "add_generation_prompt applies to messages", "add_generation_prompt")
        tokenizer = state.require_tokenizer("there is nothing to tokenize with", "prompt")
        if body.add_special_tokens is None:  # as /v1/completions tokenizes it
            ids = encode_prompt(tokenizer, body.prompt)
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.info().max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize", tags=["vllm"], responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _checked_state(request, body.model)
    ids = state.checked_token_ids(body.tokens, "tokens")
    return {"prompt": state.require_tokenizer("there is nothing to detokenize with", "tokens").decode(ids)}


def _checked_state(request: Request, model: str | None) -> ServerState:
    state = server_state(request)
    state.info()  # 503 while loading
    if model is not None:
        state.check_model(model)
    return state
