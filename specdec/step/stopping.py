"""Where a request stops: EOS, stop strings (which never leak into the stream), stop token ids,
max_tokens and the context limit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specdec.sequence import Sequence


def append_until_stop(
    seq: Sequence, new: list[int], eos_token_ids: set[int], max_model_len: int
) -> tuple[list[int], list[str], str | None]:
    """Append tokens until a stop; returns (emitted ids, their text pieces, finish reason).

    EOS ends the request without being emitted (unless `ignore_eos`); a stop string ends it at the
    token that completed it, with the stop string cut from the text; a stop token id is emitted
    and ends it; tokens past a stop are dropped.

    Example: eos {2}, new [7, 2, 9] -> appends 7 and 2, emits [7], reason "stop".
    """
    emitted: list[int] = []
    pieces: list[str] = []
    reason = None
    for token in new:
        seq.token_ids.append(token)
        if not seq.params.ignore_eos and token in eos_token_ids:
            reason = "stop"
            break
        emitted.append(token)
        piece, hit = seq.detokenizer.push([token])
        pieces.append(piece)
        if hit or token in seq.params.stop_token_ids:
            return emitted, pieces, "stop"
        if seq.num_generated >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
            reason = "length"
            break
    if reason is not None:
        tail, _ = seq.detokenizer.push([], final=True)
        if pieces:
            pieces[-1] += tail
        elif tail:
            pieces.append(tail)
    return emitted, pieces, reason


class StopChecker:
    """Turns emitted token ids into stable text deltas and finds stop strings.

    Text that could be the start of a stop string is held back until it is clearly not one, so a
    client never receives part of a stop sequence. Without a tokenizer it emits no text.

    Example: stop=["\\n\\n"]; pushes "a\\n" then "\\nb" -> emits "a", then finishes with "stop" and
    the final text is "a".
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.stop = params.stop
        self._detok = None
        if tokenizer is not None:
            from specdec.target.tokenizer import IncrementalDetokenizer

            self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._full = ""
        self._emitted = 0
        self._final: str | None = None
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        return self._final if self._final is not None else self._full[: self._emitted]

    def push(self, token_ids: list[int], final: bool = False) -> tuple[str, str | None]:
        """Add tokens; returns (new stable text, "stop" if a stop string ended the request)."""
        if self._detok is None:
            return "", None
        start = max(0, len(self._full) - max((len(s) for s in self.stop), default=0))
        if token_ids:
            self._full += self._detok.step(token_ids)
        stop_at = self._find_stop(start)
        if stop_at is not None:
            return self._finish(stop_at), "stop"
        if final:
            return self._finish(len(self._full)), None
        safe = len(self._full) - self._held_back()
        delta = self._full[self._emitted : safe]
        self._emitted = max(self._emitted, safe)
        return delta, None

    def _finish(self, end: int) -> str:
        delta = self._full[self._emitted : end]
        self._final = self._full[:end]
        self._emitted = end
        return delta

    def _find_stop(self, start: int) -> int | None:
        hits = [(i, s) for s in self.stop if (i := self._full.find(s, start)) >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda hit: hit[0])
        return at

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._full)), best, -1):
                if self._full.endswith(s[:n]):
                    best = n
                    break
        return best
