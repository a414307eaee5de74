"""Structured output: a grammar (JSON object, JSON schema, regex, Lark) as a `TokenConstraint`, on
llguidance.

Why llguidance (measured on the default pair's 151,936-token vocabulary, one core,
`git show 7336cd4c7a51:docs/results/issue16/bench_grammar.py`): a JSON schema's mask costs ~0.05 ms per token, as with
xgrammar, but a schema compiles in ~5 ms against xgrammar's ~130 ms (every request may bring a new
schema), its matcher consumes a list of drafts and rolls them back in one call each, and it names
the tokens the grammar forces (`compute_ff_tokens`), which grammar-forced drafting proposes for
free. The tokenizer is compiled once per engine (~2 s, at the first structured request).

Under speculation the engine asks for one mask per verify row and per draft row, each after the
committed tokens plus the drafts before that row (`allowed(extra)`): the matcher consumes
`extra`, fills the mask and rolls back, so its state is always the committed tokens'. A step asks
for the same prefixes twice (the draft row that proposes d_j and the verify row that scores it),
so masks are kept per prefix until the next commit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from specdec.sampling_params import StructuredSpec

# OpenAI's JSON mode and strict schemas: compact separators, no free whitespace (the model cannot
# pad the answer with newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarConstraint:
    """One request's grammar state (an `llguidance.LLMatcher` over its committed tokens).

    EOS is allowed exactly where the grammar may end and is the only token allowed where it must.

    >>> c = compiler.constraint(StructuredSpec.json_object())   # doctest: +SKIP
    >>> c.allowed([], vocab)        # [V] bool: '{' (and whitespace-free variants) only
    """

    def __init__(self, matcher: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._eos_ids = list(eos_ids)
        # One bit per token, as llguidance writes it (llguidance.torch would import torch._dynamo: 2 s).
        self._bitmask = np.zeros((vocab + 31) // 32, dtype=np.int32)  # [ceil(V / 32)]
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}  # prefix after the commit -> [V] bool

    def allowed(self, extra: Sequence[int], vocab: int) -> torch.Tensor:  # [vocab] bool
        key = tuple(extra)
        mask = self._masks.get(key)
        if mask is None:
            mask = self._masks[key] = self._compute(key, vocab)
        return mask

    def _compute(self, extra: tuple[int, ...], vocab: int) -> torch.Tensor:
        m = self._matcher
        consumed = m.try_consume_tokens(list(extra)) if extra else 0
        try:
            if consumed < len(extra):
                # A draft before this row breaks the grammar (a prompt-lookup draft: the model's
                # drafts are masked), so its own row rejects it with certainty and this row is never
                # sampled; any mask without NaNs will do.
                return torch.ones(vocab, dtype=torch.bool)
            m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        finally:
            if consumed:
                m.rollback(consumed)
        # bit i of mask byte j is token 8 j + i (little-endian words)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # [32 * words] uint8
        mask = torch.from_numpy(bits[: self._vocab].view(np.bool_))
        if vocab > self._vocab:  # the LM head's padding rows are never tokens
            mask = torch.cat([mask, torch.zeros(vocab - self._vocab, dtype=torch.bool)])
        return mask[:vocab]

    def forced(self, extra: Sequence[int], most: int) -> list[int]:
        """Up to `most` tokens the grammar forces after the committed tokens plus `extra` (the
        ones any sampler must emit there, the target's included); [] where it allows a choice."""
        m = self._matcher
        consumed = m.try_consume_tokens(list(extra)) if extra else 0
        try:
            if consumed < len(extra):
                return []
            return [t for t in m.compute_ff_tokens()[:most] if t not in self._eos_ids]
        finally:
            if consumed:
                m.rollback(consumed)

    def commit(self, token_ids: Sequence[int]) -> None:
        self._masks.clear()
        if token_ids and not self._matcher.consume_tokens(list(token_ids)):
            raise RuntimeError(f"an emitted token broke the grammar: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return self._matcher.is_stopped()


class GrammarCompiler:
    """Compiles `StructuredSpec`s for one tokenizer: the tokenizer's token table once (on first
    use), each grammar once (cached by spec). `constraint(spec)` gives a fresh request state.

    `vocab` is the model's vocabulary (the LM head's rows, which may exceed the tokenizer's);
    `eos_ids` the tokens that end an answer (all of them are allowed where the grammar may end).
    `ll_tokenizer`: an `llguidance.LLTokenizer` already built (tests over a toy vocabulary),
    instead of the transformers `tokenizer`.
    """

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Iterable[int], ll_tokenizer: Any = None) -> None:
        if tokenizer is None and ll_tokenizer is None:
            raise ValueError("structured output needs the engine's tokenizer")
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos_ids = sorted(eos_ids)
        self._ll_tokenizer = ll_tokenizer
        self._grammars: dict[StructuredSpec, str] = {}

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            n_vocab = max(self.vocab, len(self.tokenizer))
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=n_vocab, eos_token=self.eos_ids)
        return self._ll_tokenizer

    def grammar(self, spec: StructuredSpec) -> str:
        """The spec's llguidance grammar; ValueError for a schema or regex it cannot compile."""
        grammar = self._grammars.get(spec)
        if grammar is None:
            grammar = _to_grammar(spec)
            import llguidance

            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
            if is_error:
                raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {messages[0] if messages else 'rejected'}")
            self._grammars[spec] = grammar
        return grammar

    def constraint(self, spec: StructuredSpec) -> GrammarConstraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {matcher.get_error()}")
        return GrammarConstraint(matcher, self.vocab, self.eos_ids)


def _to_grammar(spec: StructuredSpec) -> str:
    import llguidance

    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    schema = json.loads(spec.source) if spec.kind == "json_schema" else {"type": "object"}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise ValueError(f"invalid json schema: {error}") from error
