"""Incremental text for one request, with stop strings that never leak into the stream."""

from __future__ import annotations

from typing import Any

from specdec.sampling_params import SamplingParams


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
        hits = [i for s in self.stop if (i := self._full.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._full)), best, -1):
                if self._full.endswith(s[:n]):
                    best = n
                    break
        return best
