"""Tokenizer loading, chat templates and incremental (streaming) detokenization."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# gpt-oss's harmony format: an answer's messages are framed by these special tokens
# (`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`), so the
# answer's text keeps them (the parser reads channels and calls from them); `<|return|>` and `<|call|>`
# end the answer (generation_config.json lists them beside the config's EOS), so they are stops.
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
HARMONY_ENDS = ("<|return|>", "<|call|>")
# How many prompt tokens give the first generated token its context (a leading space, say).
_PROMPT_CONTEXT_MIN, _PROMPT_CONTEXT_MAX = 5, 24


def load_tokenizer(folder: str | Path) -> Any:
    """The transformers tokenizer saved in `folder` (tokenizer.json + tokenizer_config.json ...)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise ValueError(f"Could not load a tokenizer from {str(folder)!r}: {error}") from error


# What transformers reads a tokenizer from; tokenizer.json alone defines the token -> id map of a fast one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether folders `a` and `b` hold byte-identical tokenizer files (a `tokenizer.json` in both,
    and the same others): the same tokenizer, without loading the second one (~1.5 s for Qwen2.5's
    151k tokens; the default pair's are identical)."""
    a, b = Path(a), Path(b)
    if not (a / "tokenizer.json").is_file():
        return False
    for name in TOKENIZER_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file() or (fa.is_file() and fa.read_bytes() != fb.read_bytes()):
            return False
    return True


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A raw (not chat) prompt -> token ids, led by the model's BOS where its tokenizer adds one
    (Gemma, Llama: `add_bos_token`; Qwen adds none), once: as llama.cpp and vLLM tokenize a
    completion prompt. Without it such a model reads the text as the middle of a document and
    degrades (Gemma 3 270M repeats itself). No EOS is appended, whatever the tokenizer's default."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or ids[:1] == [bos]:
        return ids
    leading = list(tokenizer.encode("", add_special_tokens=True))
    return [bos, *ids] if leading[:1] == [bos] else ids


def _special_ids(tokenizer: Any, names: Sequence[str]) -> tuple[int, ...]:
    """The ids of `names` where every one is an added token of the vocabulary, else ()."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return tuple(added[n] for n in names) if all(n in added for n in names) else ()


def kept_special_ids(tokenizer: Any) -> frozenset[int]:
    """Special tokens an answer's text keeps: harmony's markers where the vocabulary has them
    (gpt-oss), none elsewhere. Cached on the tokenizer, by its size (tokens added later count)."""
    if not hasattr(tokenizer, "get_added_vocab"):
        return frozenset()
    size = len(tokenizer)
    cached = getattr(tokenizer, "_specdec_kept_ids", None)
    if cached is not None and cached[0] == size:
        return cached[1]
    kept = frozenset(_special_ids(tokenizer, HARMONY_MARKERS + HARMONY_ENDS)[:len(HARMONY_MARKERS)])
    try:
        tokenizer._specdec_kept_ids = (size, kept)
    except AttributeError:
        pass
    return kept


def end_of_answer_ids(tokenizer: Any) -> tuple[int, ...]:
    """Tokens that end an answer beside the config's EOS: harmony's `<|return|>` and `<|call|>`."""
    return _special_ids(tokenizer, HARMONY_MARKERS + HARMONY_ENDS)[len(HARMONY_MARKERS):]


def is_chat_model(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template (instruct / chat models do)."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user message, ready for the assistant's reply.

    The template renders to text first and is then encoded without extra special tokens, since
    templates write their own BOS / turn markers.
    """
    if not is_chat_model(tokenizer):
        raise ValueError(
            "This model's tokenizer has no chat template, so the prompt cannot be wrapped as a "
            "chat message; pass --no-chat to feed the prompt as plain text."
        )
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a whole conversation (`[{"role": ..., "content": ...}, ...]`), ready for the
    assistant's next reply.

    Rendered like `apply_chat_template` (text first, then encoded without extra special tokens),
    so a conversation's first turn gets the same ids as the single prompt. A later turn's ids
    start with the earlier turns' wherever the template renders old turns unchanged (ChatML
    does), which is what lets the prefix cache reuse them.
    """
    if not is_chat_model(tokenizer):
        raise ValueError("This model's tokenizer has no chat template, so a conversation cannot "
                         "be formatted for it.")
    if not messages:
        raise ValueError("the conversation has no messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"message {i} needs a string 'role' and a string 'content', got {m!r}")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True
        )
    except TemplateError as error:  # e.g. a template that insists roles alternate
        raise ValueError(f"the chat template rejected these messages: {error}") from error
    return list(tokenizer.encode(text, add_special_tokens=False))


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into newly stable text, chunk by chunk.

    vLLM's scheme: decode only a window of tokens `[prefix_offset, end)`. `prefix_text` (the
    window up to `read_offset`) was already emitted; whatever the full window decodes to beyond it
    is new. Text ending in the replacement char is an incomplete UTF-8 sequence (a character split
    across tokens) and is held back until later tokens complete it. Every call decodes a window of
    a few tokens, never the whole output. Special tokens are skipped, but for those the answer's
    format is written in (`kept_special_ids`: gpt-oss's harmony markers), which are kept as text.

        >>> detok = IncrementalDetokenizer(tokenizer, prompt_ids)   # doctest: +SKIP
        >>> detok.step([9707]), detok.step([11, 1879])               # doctest: +SKIP
        ('Hello', ', world')
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._kept = kept_special_ids(tokenizer)
        # The window: ids from the prefix offset on (so the prefix offset is always 0 here).
        self._ids: list[int] = self._prompt_context(list(prompt_ids))
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def step(self, new_ids: list[int]) -> str:
        """Append `new_ids` (any number, possibly none); return the text that became stable."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_tokens += len(new_ids)
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character still split across tokens
        new_text = full_text[len(prefix_text) :]
        # Slide the window: the old read offset becomes the new prefix offset.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._chunks.append(new_text)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._kept and not self._kept.isdisjoint(ids):  # the kept ones as text, the runs between decoded
            parts, run = [], []
            for i in ids:
                if i in self._kept:
                    parts += [self._decode_run(run), self.tokenizer.convert_ids_to_tokens(i)]
                    run = []
                else:
                    run.append(i)
            return "".join(parts) + self._decode_run(run)
        return self._decode_run(ids)

    def _decode_run(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The shortest prompt tail (5..24 tokens) that decodes cleanly, so the first generated
        tokens merge with it as they would in the full text; [] if none does."""
        if len(prompt_ids) <= _PROMPT_CONTEXT_MIN:
            tail = prompt_ids
            return tail if REPLACEMENT_CHAR not in self._decode(tail) else []
        for size in range(_PROMPT_CONTEXT_MIN, min(len(prompt_ids), _PROMPT_CONTEXT_MAX) + 1):
            tail = prompt_ids[-size:]
            if REPLACEMENT_CHAR not in self._decode(tail):
                return tail
        return []
