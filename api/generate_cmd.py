"""`specdec generate "prompt"`: stream an answer with live acceptance statistics."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.api.reasoning import is_harmony
from specdec.sampling_params import StructuredSpec
from specdec.sequence import StepDelta, TokenLogprobs, TokenOrigin
from specdec.verify import AcceptanceStats

if TYPE_CHECKING:
    from rich.console import Console

    from specdec.config import EngineConfig
    from specdec.engine import Engine

ORIGIN_STYLES = {
    TokenOrigin.ACCEPTED: "green",
    TokenOrigin.RECOVERED: "bold red",
    TokenOrigin.BONUS: "cyan",
    TokenOrigin.TARGET: "",
}
LEGEND = ("[green]accepted draft[/green] · [bold red]corrected by target[/bold red]"
          " · [cyan]bonus[/cyan] · plain target")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts, streamed")
    p.add_argument("prompts", nargs="+", help="prompt text (several prompts are batched)")
    p.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template (default for chat models)")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="raw completion")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the answer, print each token's log-probability under the target and "
                        "its N most likely alternatives (0..20; from the verify pass)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE",
                   help="constrain the answer to this JSON schema (a .json file); it ends where the JSON does")
    g.add_argument("--json", action="store_true", help="constrain the answer to a JSON object")
    add_answer_args(p)
    p.set_defaults(func=run)


def structured_from_args(args: argparse.Namespace) -> StructuredSpec | None:
    """`--json-schema FILE` / `--json` as a StructuredSpec (ValueError: unreadable or not JSON)."""
    if args.json:
        return StructuredSpec.json_object()
    if args.json_schema is None:
        return None
    try:
        text = Path(args.json_schema).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"--json-schema: cannot read {args.json_schema!r}: {error}") from error
    return StructuredSpec.json_schema(text)


def add_answer_args(p: argparse.ArgumentParser) -> None:
    """The flags of the commands that load an engine and stream answers (generate, chat): how
    answers are shown, the warm-up, the engine and sampling."""
    from specdec.api.args import add_engine_args, add_sampling_args, add_warmup_arg

    p.add_argument("--show-acceptance", action="store_true",
                   help="color each token: green accepted draft, red corrected by the target, "
                        "cyan bonus")
    p.add_argument("--quiet-stats", action="store_true", help="no statistics line")
    add_warmup_arg(p)
    add_engine_args(p)
    add_sampling_args(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from specdec.api.args import engine_config_from_args, sampling_params_from_args

    params = replace(sampling_params_from_args(args), logprobs=args.logprobs, structured=structured_from_args(args))
    config = engine_config_from_args(args)
    err = Console(stderr=True, highlight=False)
    engine, load_s, warm_s = load_engine(config, err, args.warmup)
    chat = args.chat if args.chat is not None else _is_chat(engine)
    prompt_ids = [engine.encode(p, chat=chat) for p in args.prompts]
    if not args.quiet_stats:
        err.print(f"[dim]{loaded_line(load_s, warm_s)} · {describe_engine(config, engine)} · chat={chat} · "
                  f"{engine.memory_line()}[/dim]")
    out = Console(highlight=False, soft_wrap=True)
    printer = StreamPrinter(out, err, len(prompt_ids), args.show_acceptance, not args.quiet_stats,
                            num_prompt_tokens=sum(len(ids) for ids in prompt_ids),
                            harmony=chat and is_harmony(engine.tokenizer))
    t_start = time.perf_counter()
    logprobs: dict[str, list[TokenLogprobs]] = {}
    try:
        for delta in engine.stream(prompt_ids, params):
            printer.add(delta)
            logprobs.setdefault(delta.request_id, []).extend(delta.logprobs or [])
    finally:  # an interrupted run must still hand the terminal back from the live region
        printer.close(time.perf_counter() - t_start)
    if engine.expert_stats is not None and not args.quiet_stats:
        err.print(f"[dim]{engine.expert_stats.summary()}[/dim]")
    if params.logprobs is not None:
        for request_id, entries in logprobs.items():
            out.print(logprobs_table(entries, engine.tokenizer, request_id if len(logprobs) > 1 else None))
    return 0


def logprobs_table(entries: list[TokenLogprobs], tokenizer, title: str | None = None):
    """A rich table: each token, its logprob and probability, and the alternatives at its position."""
    from rich.table import Table

    from specdec.api.logprobs import TokenTexts

    texts = TokenTexts(tokenizer)
    table = Table(title=title, box=None, pad_edge=False, header_style="bold")
    for column, justify in (("#", "right"), ("token", "left"), ("logprob", "right"), ("p", "right"),
                            ("most likely at this position", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for i, entry in enumerate(entries):
        top = "  ".join(f"{texts(t)[0]!r} {lp:.3f}" for t, lp in entry.top)
        table.add_row(str(i), repr(texts(entry.token_id)[0]), f"{entry.logprob:.4f}",
                      f"{math.exp(entry.logprob):.3f}", top)
    return table


def load_engine(config: EngineConfig, err: Console, warmup: bool = True) -> tuple[Engine, float, float | None]:
    """(engine, seconds it took to load, seconds its warm-up took or None), with a spinner on the
    `err` console meanwhile."""
    from specdec.engine import Engine
    from specdec.warmup import warm_up

    t0 = time.perf_counter()
    with err.status("loading models (the first run converts the GGUF files; later runs take seconds)"):
        engine = Engine(config)
    load_s = time.perf_counter() - t0
    if not warmup:
        return engine, load_s, None
    with err.status("warming up (one short greedy and one sampled request through both models)"):
        report = warm_up(engine)
    return engine, load_s, report.seconds


def loaded_line(load_s: float, warm_s: float | None) -> str:
    return f"loaded in {load_s:.1f}s" + (f", warmed up in {warm_s:.1f}s" if warm_s is not None else "")


def describe_engine(config: EngineConfig, engine=None) -> str:
    """The loaded line's summary of a config: proposer and k, the draft's vocabulary where its head
    is cut (`engine`), dtype, prefix caching if off, and on the CPU what runs the C kernels
    ("kernels: avx2 (SPECDEC_ISA=avx2; this CPU: avx512-vnni)")."""
    from specdec import native

    config = engine.config if engine is not None else config  # what runs (a target alone: prompt lookup)
    mode = "target only" if not config.speculative else f"{config.proposer} proposer, k={config.num_speculative_tokens}"
    if engine is not None and engine.proposer_note:
        mode += f" ({engine.proposer_note})"
    for runner in (engine.runners[1:] if engine is not None else []):
        if (ids := getattr(runner.model, "head_ids", None)) is not None:
            mode += f", draft vocab {len(ids)}/{runner.model.config.vocab_size}"
    text = f"{mode} · {config.dtype}"
    if not config.enable_prefix_caching:
        text += " · prefix caching off"
    return text + (f" · {native.describe_simd()}" if config.resolved_device() == "cpu" else "")


def _is_chat(engine) -> bool:
    from specdec.target.tokenizer import is_chat_model

    return engine.tokenizer is not None and is_chat_model(engine.tokenizer)


def stats_line(
    num_tokens: int, elapsed: float, ttft: float | None, acceptance: AcceptanceStats,
    num_cached: int = 0, num_prompt_tokens: int = 0, always_show_cached: bool = False,
) -> str:
    """The statistics line: tokens, tok/s, TTFT, acceptance when anything was drafted, and the
    prompt tokens served from the prefix cache (when any were, or always with `always_show_cached`)."""
    line = (
        f"{num_tokens} tokens in {elapsed:.2f}s · {num_tokens / max(elapsed, 1e-9):.2f} tok/s"
        f" · TTFT {ttft or 0:.2f}s"
    )
    if acceptance.num_draft_tokens:
        line += (
            f" · acceptance {acceptance.acceptance_rate:.1%} · mean accepted length "
            f"{acceptance.mean_accepted_length:.2f} tokens per target pass"
        )
    if num_cached or always_show_cached:
        line += f" · cached {num_cached}/{num_prompt_tokens} prompt tokens"
    return line


class HarmonyView:
    """A gpt-oss answer as the terminal shows it, piece by piece: its messages' markers read
    (`specdec.api.harmony`), each block (the reasoning, shown dim; the answer; a call, as
    `→ name(arguments)`) after a blank line."""

    def __init__(self) -> None:
        from specdec.api.harmony import HarmonyParser

        self._parser = HarmonyParser()
        self._block = ""  # the block shown last: "reasoning", "text" or "call"

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """(text, "reasoning" or "text") parts of `piece`."""
        return self._parts(self._parser.feed(piece))

    def finish(self) -> list[tuple[str, str]]:
        return self._parts(self._parser.finish()) + ([(")", "text")] if self._block == "call" else [])

    def _parts(self, events: list) -> list[tuple[str, str]]:
        from specdec.api.reasoning import ReasoningDelta
        from specdec.api.tool_calls import ArgumentsDelta, CallStart

        parts = []
        for event in events:
            starts = isinstance(event, CallStart)
            block = "call" if starts or isinstance(event, ArgumentsDelta) else (
                "reasoning" if isinstance(event, ReasoningDelta) else "text")
            if self._block and (starts or block != self._block):
                parts.append((")\n\n" if self._block == "call" else "\n\n", "text"))
            parts.append((f"→ {event.name}(" if starts else event.text, "reasoning" if block == "reasoning" else "text"))
            self._block = block
        return parts


class StreamPrinter:
    """Streams one prompt live; with several prompts, prints each answer as it finishes.

    On a terminal the single answer is shown in a rich `Live` region whose last line carries the
    running statistics (tokens, tok/s, acceptance); piped output is plain streamed text. The
    statistics count this printer's deltas only, so they hold per answer on a long-lived engine
    (`specdec chat`). `num_prompt_tokens` is the prompts' total length, for the cached count.
    `harmony`: gpt-oss chat answers, shown as their messages read (`HarmonyView`), not as markers.
    """

    def __init__(
        self, out, err, num_prompts: int, colors: bool, stats: bool, num_prompt_tokens: int = 0,
        stats_style: str = "bold", always_show_cached: bool = False, harmony: bool = False,
    ) -> None:
        from rich.live import Live
        from rich.text import Text

        self.out, self.err, self.colors, self.stats = out, err, colors, stats
        self.stats_style, self.always_show_cached = stats_style, always_show_cached
        self.single = num_prompts == 1
        self.num_prompt_tokens = num_prompt_tokens
        self.texts: dict[str, list] = {}
        self.answer = Text()
        self.num_tokens = 0
        self.acceptance = AcceptanceStats()
        self.cached: dict[str, int] = {}  # request id -> prompt tokens its target cache reused
        self.ttft: float | None = None
        self.t0 = time.perf_counter()
        self.live = None
        self.harmony = harmony
        self.views: dict[str, HarmonyView] = {}
        if self.single and out.is_terminal:
            self.live = Live(console=out, refresh_per_second=8, vertical_overflow="visible")
            self.live.start()

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached.values())

    def add(self, delta: StepDelta) -> None:
        from rich.text import Text

        self.num_tokens += len(delta.token_ids)
        if delta.num_drafted:  # as the engine counts: steps that drafted nothing do not dilute
            self.acceptance.update(delta.num_drafted, delta.num_accepted)
        self.cached[delta.request_id] = max(self.cached.get(delta.request_id, 0), delta.num_cached_tokens)
        if self.ttft is None and delta.token_ids:
            self.ttft = time.perf_counter() - self.t0
        text = Text()
        view = self.views.setdefault(delta.request_id, HarmonyView()) if self.harmony else None
        for piece, origin in zip(delta.pieces, delta.origins):
            style = ORIGIN_STYLES[origin] if self.colors else ""
            for part, kind in view.feed(piece) if view is not None else [(piece, "text")]:
                text.append(part, style=f"{style} dim italic" if kind == "reasoning" else style)
        if view is not None and delta.finished:
            for part, kind in view.finish():
                text.append(part, style="dim italic" if kind == "reasoning" else "")
        if self.live is not None:
            self.answer.append_text(text)
            self.live.update(self._render())
        elif self.single:
            self.out.print(text, end="")
        else:
            self.texts.setdefault(delta.request_id, []).append(text)
            if delta.finished:
                self.out.rule(delta.request_id)
                self.out.print(Text.assemble(*self.texts.pop(delta.request_id)))

    def _render(self):
        from rich.console import Group
        from rich.text import Text

        if not self.stats:
            return self.answer
        return Group(self.answer, Text(self.stats_line(time.perf_counter() - self.t0), style="dim"))

    def stats_line(self, elapsed: float) -> str:
        return stats_line(self.num_tokens, elapsed, self.ttft, self.acceptance, self.num_cached_tokens,
                          self.num_prompt_tokens, self.always_show_cached)

    def close(self, elapsed: float, legend: bool = True) -> None:
        """End the answer (and the live region); print the statistics line and, with colours,
        the legend."""
        from rich.text import Text

        if self.live is not None:
            self.live.update(self.answer)
            self.live.stop()
            self.live = None
        elif self.single:
            self.out.print()
        if not self.stats:
            return
        self.err.print(Text(self.stats_line(elapsed), style=self.stats_style))
        if self.colors and legend:
            self.err.print(LEGEND)
