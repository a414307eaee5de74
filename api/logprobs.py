"""Logprob entries in OpenAI's two formats, from the engine's `TokenLogprobs`.

Chat (`choices[i].logprobs`; a stream chunk carries the entries of its own tokens):

    {"content": [{"token": " sort", "logprob": -0.02, "bytes": [32, 115, 111, 114, 116],
                  "top_logprobs": [{"token": " sort", "logprob": -0.02, "bytes": [...]}, ...]}],
     "refusal": null}

Completions (the legacy format; `top_logprobs` also holds the chosen token, as OpenAI's does, so
a dict has up to `logprobs + 1` entries; `text_offset` is each token's offset in the choice's
text, echoed prompt included):

    {"tokens": [" sort"], "token_logprobs": [-0.02], "top_logprobs": [{" sort": -0.02, ...}],
     "text_offset": [17]}

A token's text is its own bytes decoded as UTF-8 (a token that holds part of a character shows
U+FFFD there; `bytes` holds the exact bytes, so that consecutive tokens' bytes join into the text).
"""

from __future__ import annotations

import math
import re
from typing import Any

from specdec.sequence import TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -inf: OpenAI and vLLM report an impossible token's logprob so
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte fallback


class TokenTexts:
    """Each token id's (text, UTF-8 bytes) for logprob entries, looked up once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_values = _byte_level_values() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"  # vLLM's name for a token it cannot spell
            return text, list(text.encode())
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        data = None
        if isinstance(raw, str) and _BYTE_TOKEN.fullmatch(raw):
            data = bytes([int(raw[3:5], 16)])
        elif isinstance(raw, str) and self._byte_values and all(c in self._byte_values for c in raw):
            data = bytes(self._byte_values[c] for c in raw)
        if data is None:
            text = self.tokenizer.decode([token_id])
            return text, list(text.encode())
        return data.decode("utf-8", errors="replace"), list(data)


def chat_logprobs(entries: list[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """Chat's `logprobs` object for these tokens."""
    content = [
        {**_token(e.token_id, e.logprob, texts), "top_logprobs": [_token(t, lp, texts) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprobs], texts: TokenTexts, text_offset: int) -> dict[str, Any]:
    """The completions (legacy) `logprobs` object for these tokens, the first at `text_offset`."""
    tokens, offsets, tops = [], [], []
    for entry in entries:
        text = texts(entry.token_id)[0]
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top = {texts(t)[0]: finite(lp) for t, lp in entry.top}
        top[text] = finite(entry.logprob)  # the chosen token's own, should another spell the same
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [finite(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def prompt_completion_logprobs(prompt_ids: list[int], entries: list[TokenLogprobs | None],
                               texts: TokenTexts) -> dict[str, Any]:
    """The legacy `logprobs` of an echoed prompt (`entries`: None for the first token, then the
    others'): the first token's logprob and alternatives null, as OpenAI's; offsets from 0."""
    rest = completion_logprobs([e for e in entries[1:] if e is not None], texts, 0)
    first = texts(prompt_ids[0])[0]
    return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + [o + len(first) for o in rest["text_offset"]]}


def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], texts: TokenTexts | None) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {token id: {logprob, rank,
    decoded_token}} for the token and its alternatives (rank 1 = the most likely)."""
    out: list[Any] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {t: (lp, r + 1) for r, (t, lp) in enumerate(entry.top)}
        ranked.setdefault(entry.token_id, (entry.logprob, entry.rank))
        out.append({str(t): {"logprob": finite(lp), "rank": rank,
                             "decoded_token": texts(t)[0] if texts is not None else None}
                    for t, (lp, rank) in ranked.items()})
    return out


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text, data = texts(token_id)
    return {"token": text, "logprob": finite(logprob), "bytes": data}


def _is_byte_level(tokenizer: Any) -> bool:
    """GPT-2-style byte-level BPE (Qwen, Llama 3): each token is a string over a 256-char alphabet."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in type(backend.decoder).__name__


def _byte_level_values() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable bytes stand for themselves, the others
    for chr(256 + i) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for i, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + i)
    return {c: b for b, c in chars.items()}
