"""`specdec chat`: a multi-turn terminal chat with live acceptance and prefix-cache statistics.

Every turn sends the whole conversation through the chat template, as a chat client sends its
history to a server. The engine's prefix cache already holds the earlier turns' KV (prompt and
answer), so only the new turn is computed: the statistics line's `cached N/M prompt tokens` shows
it, and the time to first token stays small however long the conversation grows.

Ctrl-C while an answer streams stops that answer between two engine steps, aborts its request
(its blocks are freed) and keeps the partial answer in the history, as it was shown; an answer
interrupted before its first token drops the question too. Ctrl-C or Ctrl-D at the prompt leaves.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdec.sequence import StepDelta

if TYPE_CHECKING:
    from rich.console import Console

    from specdec.engine import Engine
    from specdec.sampling_params import SamplingParams

PROMPT = "you> "
INTERRUPTED = "interrupted"  # a Turn's finish reason when Ctrl-C stopped it
HELP = ("/reset forgets the conversation (the system prompt stays) · /exit or Ctrl-D leaves · "
        "Ctrl-C stops an answer, or leaves at the prompt")


def register(sub: argparse._SubParsersAction) -> None:
    from specdec.api.generate_cmd import add_answer_args

    p = sub.add_parser("chat", help="multi-turn chat in the terminal, streamed (earlier turns "
                                    "come from the prefix cache)")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt for the conversation")
    add_answer_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.api.args import engine_config_from_args, sampling_params_from_args
    from specdec.api.generate_cmd import LEGEND, describe_engine, load_engine, loaded_line
    from specdec.target.tokenizer import is_chat_model

    params = sampling_params_from_args(args)
    config = engine_config_from_args(args)
    err = Console(stderr=True, highlight=False)
    engine, load_s, warm_s = load_engine(config, err, args.warmup)
    if engine.tokenizer is None or not is_chat_model(engine.tokenizer):
        raise ValueError("`specdec chat` needs a model whose tokenizer has a chat template (an "
                         "instruct model); `specdec generate --no-chat` completes plain text")
    if not args.quiet_stats:
        err.print(f"[dim]{loaded_line(load_s, warm_s)} · {describe_engine(config, engine)} · {engine.memory_line()}[/dim]")
    err.print(f"[dim]{HELP}[/dim]")
    if args.show_acceptance:
        err.print(LEGEND)
    out = Console(highlight=False, soft_wrap=True)
    session = ChatSession(engine, params, args.system)
    chat_loop(session, input, out, err, colors=args.show_acceptance, stats=not args.quiet_stats)
    return 0


@dataclass
class Turn:
    """One answer: the prompt it was given (the whole conversation) and what came back."""

    prompt_ids: list[int]
    text: str
    num_tokens: int
    num_cached_tokens: int  # prompt tokens served from the target's prefix cache
    finish_reason: str | None  # "stop", "length" or INTERRUPTED

    @property
    def interrupted(self) -> bool:
        return self.finish_reason == INTERRUPTED


class ChatSession:
    """A conversation with an engine: the {role, content} history and one request per turn.

    Each `ask` encodes the whole history through the tokenizer's chat template (as a client of a
    chat server would send it) and runs it as a fresh request; the prefix cache makes the resent
    history cheap.
    """

    def __init__(self, engine: Engine, params: SamplingParams, system: str | None = None) -> None:
        if engine.tokenizer is None:
            raise ValueError("a chat needs an engine with a tokenizer")
        self.engine, self.params, self.system = engine, params, system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation; the system prompt stays."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def ask(
        self, text: str, on_delta: Callable[[StepDelta], Any] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_start: Callable[[list[int]], Any] | None = None,
    ) -> Turn:
        """Answer `text` given the history; both join the history.

        `on_start(prompt_ids)` runs once the request is queued, `on_delta` for each of its
        deltas. The answer stops early when `should_stop()` turns true (checked after every
        engine step) or a KeyboardInterrupt escapes a step or `on_delta`: the request is then
        aborted and the turn's finish reason is INTERRUPTED. Raises ValueError, leaving the
        history as it was, when the conversation no longer fits the engine.
        """
        from specdec.target.tokenizer import encode_chat

        self.messages.append({"role": "user", "content": text})
        try:
            prompt_ids = encode_chat(self.engine.tokenizer, self.messages)
            request_id = self.engine.add_request(prompt_ids, self.params)
        except ValueError:
            self.messages.pop()  # the question never ran
            raise
        texts: list[str] = []
        num_tokens = num_cached = 0
        reason: str | None = None
        finished = interrupted = False
        try:
            if on_start is not None:
                on_start(prompt_ids)
            while not finished and self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.request_id != request_id:
                        continue
                    texts.append(delta.text)
                    num_tokens += len(delta.token_ids)
                    num_cached = max(num_cached, delta.num_cached_tokens)
                    finished, reason = delta.finished, delta.finish_reason
                    if on_delta is not None:
                        on_delta(delta)
                if not finished and should_stop is not None and should_stop():
                    interrupted = True
                    break
        except KeyboardInterrupt:
            interrupted = not finished
        except Exception:
            self.messages.pop()  # a failed turn leaves no half of itself in the history
            raise
        finally:
            # Frees the request's blocks in both pools if it still runs; forgets it either way.
            self.engine.abort(request_id)
        answer = "".join(texts)
        if interrupted and not answer:
            self.messages.pop()  # nothing was said: drop the question too, so roles still alternate
        else:
            # A partial answer stays, as shown: the next turn continues from what the user saw.
            self.messages.append({"role": "assistant", "content": _history_text(self.engine.tokenizer, answer)})
        return Turn(prompt_ids, answer, num_tokens, num_cached, INTERRUPTED if interrupted else reason)


def _history_text(tokenizer: Any, answer: str) -> str:
    """What the conversation keeps of an answer: gpt-oss's final message (its template writes an
    earlier answer into a final-channel message and leaves its reasoning out); others' as it is."""
    from specdec.api.answer import AnswerParser, whole_answer
    from specdec.api.reasoning import is_harmony

    if not is_harmony(tokenizer):
        return answer
    return "".join(b.text for b in whole_answer(AnswerParser(False, False, False, harmony=True), answer)
                   if b.kind == "text")


class InterruptFlag:
    """Within `with`, a first Ctrl-C (SIGINT) sets `requested` instead of raising.

    The chat then stops the answer between two engine steps rather than inside one, where a
    KeyboardInterrupt could leave the scheduler or a block table half updated. A second Ctrl-C
    raises KeyboardInterrupt as usual (a step that hangs can still be left). Off the main thread,
    where Python cannot set signal handlers, it changes nothing.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> InterruptFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            # None: the previous handler was not set from Python and cannot be put back as is.
            previous = self._previous if self._previous is not None else signal.default_int_handler
            signal.signal(signal.SIGINT, previous)
            self._installed = False


def chat_loop(
    session: ChatSession, read: Callable[[str], str] = input, out: Console | None = None,
    err: Console | None = None, colors: bool = False, stats: bool = True,
) -> None:
    """Read lines with `read(PROMPT)` (`input`, or a script in tests) and answer them until /exit,
    end of input (EOFError) or Ctrl-C at the prompt. Answers stream to `out`; statistics and
    notices go to `err`."""
    from rich.console import Console

    out = out or Console(highlight=False, soft_wrap=True)
    err = err or Console(stderr=True, highlight=False)
    while True:
        try:
            line = read(PROMPT)
        except (EOFError, KeyboardInterrupt):
            out.print()  # end the prompt's line
            return
        text = line.strip()
        if not text:
            continue
        if _is_command(text):
            command = text.lower()
            if command in ("/exit", "/quit"):
                return
            if command == "/reset":
                session.reset()
                err.print("[dim]conversation cleared[/dim]")
            elif command == "/help":
                err.print(f"[dim]{HELP}[/dim]")
            else:
                err.print(f"unknown command {text}; {HELP}", markup=False)
            continue
        answer(session, text, out, err, colors, stats)


def _is_command(text: str) -> bool:
    """`/word` alone on the line; a message such as "/etc/hosts holds what?" is still a message."""
    return text.startswith("/") and len(text.split()) == 1


def answer(
    session: ChatSession, text: str, out: Console, err: Console, colors: bool = False,
    stats: bool = True,
) -> Turn | None:
    """One turn, streamed to `out` with a dim statistics line on `err`; None if the turn could not
    run (the reason is printed and the chat goes on)."""
    from specdec.api.generate_cmd import StreamPrinter
    from specdec.api.reasoning import is_harmony

    printers: list[StreamPrinter] = []
    harmony = is_harmony(session.engine.tokenizer)

    def start(prompt_ids: list[int]) -> None:
        printers.append(StreamPrinter(out, err, 1, colors, stats, num_prompt_tokens=len(prompt_ids),
                                      stats_style="dim", always_show_cached=True, harmony=harmony))

    try:
        with InterruptFlag() as flag:
            turn = session.ask(text, lambda delta: printers[0].add(delta), lambda: flag.requested, start)
    except ValueError as exc:
        err.print(f"error: {exc}; /reset starts a new conversation", style="red", markup=False)
        return None
    finally:
        if printers:  # also on the way out of an error: the live region must hand the terminal back
            printers[0].close(time.perf_counter() - printers[0].t0, legend=False)
    if turn.interrupted:
        kept = "the partial answer stays in the conversation" if turn.text else "the question is dropped"
        err.print(f"[dim]interrupted: {kept}[/dim]")
    return turn
