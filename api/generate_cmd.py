"""`specdec generate "prompt"`: stream an answer with live acceptance statistics."""

from __future__ import annotations

import argparse
import time

from specdec.sequence import StepDelta, TokenOrigin

ORIGIN_STYLES = {
    TokenOrigin.ACCEPTED: "green",
    TokenOrigin.RECOVERED: "bold red",
    TokenOrigin.BONUS: "cyan",
    TokenOrigin.TARGET: "",
}


def register(sub: argparse._SubParsersAction) -> None:
    from specdec.api.cli import add_engine_args, add_sampling_args

    p = sub.add_parser("generate", help="generate text for one or more prompts, streamed")
    p.add_argument("prompts", nargs="+", help="prompt text (several prompts are batched)")
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default for chat models)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="raw completion")
    p.add_argument("--show-acceptance", action="store_true",
                   help="color each token: green accepted draft, red corrected by the target, "
                        "cyan bonus")
    p.add_argument("--quiet-stats", action="store_true", help="no statistics line")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.api.cli import engine_config_from_args, sampling_params_from_args
    from specdec.engine import Engine

    params = sampling_params_from_args(args)
    config = engine_config_from_args(args)
    err = Console(stderr=True, highlight=False)
    t0 = time.perf_counter()
    with err.status("loading models (the first run converts the GGUF files; later runs take seconds)"):
        engine = Engine(config)
    load_s = time.perf_counter() - t0
    chat = args.chat if args.chat is not None else _is_chat(engine)
    prompt_ids = [engine.encode(p, chat=chat) for p in args.prompts]
    if not args.quiet_stats:
        mode = "target only" if not config.speculative else f"{config.proposer} proposer, k={config.num_speculative_tokens}"
        err.print(f"[dim]loaded in {load_s:.1f}s · {mode} · {config.dtype} · chat={chat}[/dim]")
    out = Console(highlight=False, soft_wrap=True)
    printer = _StreamPrinter(out, err, len(prompt_ids), args.show_acceptance, not args.quiet_stats)
    t_start = time.perf_counter()
    for delta in engine.stream(prompt_ids, params):
        printer.add(delta, engine)
    printer.close(engine, time.perf_counter() - t_start)
    return 0


def _is_chat(engine) -> bool:
    from specdec.target.tokenizer import is_chat_model

    return engine.tokenizer is not None and is_chat_model(engine.tokenizer)


class _StreamPrinter:
    """Streams one prompt live; with several prompts, prints each answer as it finishes.

    On a terminal the single answer is shown in a rich `Live` region whose last line carries the
    running statistics (tokens, tok/s, acceptance); piped output is plain streamed text.
    """

    def __init__(self, out, err, num_prompts: int, colors: bool, stats: bool) -> None:
        from rich.live import Live
        from rich.text import Text

        self.out, self.err, self.colors, self.stats = out, err, colors, stats
        self.single = num_prompts == 1
        self.texts: dict[str, list] = {}
        self.answer = Text()
        self.num_tokens = 0
        self.ttft: float | None = None
        self.t0 = time.perf_counter()
        self.live = None
        if self.single and out.is_terminal:
            self.live = Live(console=out, refresh_per_second=8, vertical_overflow="visible")
            self.live.start()

    def add(self, delta: StepDelta, engine) -> None:
        from rich.text import Text

        self.num_tokens += len(delta.token_ids)
        if self.ttft is None and delta.token_ids:
            self.ttft = time.perf_counter() - self.t0
        text = Text()
        for piece, origin in zip(delta.pieces, delta.origins):
            text.append(piece, style=ORIGIN_STYLES[origin] if self.colors else "")
        if self.live is not None:
            self.answer.append_text(text)
            self.live.update(self._render(engine))
        elif self.single:
            self.out.print(text, end="")
        else:
            self.texts.setdefault(delta.request_id, []).append(text)
            if delta.finished:
                self.out.rule(delta.request_id)
                self.out.print(Text.assemble(*self.texts.pop(delta.request_id)))

    def _render(self, engine):
        from rich.console import Group
        from rich.text import Text

        if not self.stats:
            return self.answer
        return Group(self.answer, Text(self._stats_line(engine, time.perf_counter() - self.t0), style="dim"))

    def _stats_line(self, engine, elapsed: float) -> str:
        s = engine.stats
        line = (
            f"{self.num_tokens} tokens in {elapsed:.2f}s · {self.num_tokens / max(elapsed, 1e-9):.2f} tok/s"
            f" · TTFT {self.ttft or 0:.2f}s"
        )
        if s.num_draft_tokens:
            line += (
                f" · acceptance {s.acceptance_rate:.1%} · mean accepted length "
                f"{s.mean_accepted_length:.2f} tokens per target pass"
            )
        return line

    def close(self, engine, elapsed: float) -> None:
        if self.live is not None:
            self.live.update(self.answer)
            self.live.stop()
        elif self.single:
            self.out.print()
        if not self.stats:
            return
        self.err.print(f"[bold]{self._stats_line(engine, elapsed)}[/bold]")
        if self.colors:
            self.err.print("[green]accepted draft[/green] · [bold red]corrected by target[/bold red]"
                           " · [cyan]bonus[/cyan] · plain target")
