"""Where the running streams' longest gaps fall, per layout, against the long prompts' arrivals and
first tokens (the raw timeline `specdec bench serve --pd` records in pd.json); and, where pd.json
has each chunk's token count (0.14.1 on), the gaps split by the tokens the chunk carried and by
20-second stretch: a chunk of several tokens is one speculative step that drafted, a chunk of one
token a step that did not, so the gaps' spread from the speculation policy is told apart from
stalls.

    python docs/results/issue36/timeline.py docs/results/issue36/sitting-d/pd.json [N]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    report = json.load(open(sys.argv[1]))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    for name, result in report["results"].items():
        arrivals = result["long_arrivals"]
        events = arrivals.get("long_sent_first") or []
        print(f"## {name}: long prompts sent / first token at (s): "
              + ", ".join(f"{s:.1f} / {f:.1f}" for s, f in events if f is not None))
        gaps = []
        for index, chunks in enumerate(arrivals.get("stream_chunks") or []):
            gaps += [(b - a, a, index) for a, b in zip(chunks, chunks[1:]) if a >= 0]
        gaps.sort(reverse=True)
        for gap, at, index in gaps[:top]:
            near = min(((abs(at - t), label, i) for i, (s, f) in enumerate(events)
                        for t, label in ((s, "sent"), (f, "first token")) if t is not None), default=None)
            where = f"{near[0]:.1f} s from long prompt {near[2]}'s {near[1]}" if near else ""
            print(f"  stream {index}: {gap * 1000:.0f} ms gap at {at:.1f} s ({where})")
        counts = arrivals.get("stream_chunk_tokens")
        if counts:
            by_tokens(arrivals["stream_chunks"], counts, events)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def by_tokens(chunks: list[list[float]], counts: list[list[int]], events: list) -> None:
    """ITL p50 / p99 of the window's gaps (first arrival to last long first token) by chunk size,
    and each stream's median gap and tokens a chunk per 20 s."""
    end = max((f for _, f in events if f is not None), default=float("inf"))
    one, more = [], []
    for times, tokens in zip(chunks, counts):
        for (a, b), n in zip(zip(times, times[1:]), tokens[1:]):
            if b > 0 and a < end:
                (one if n == 1 else more).append(b - a)
    for label, gaps in (("1-token chunks", one), ("multi-token chunks", more), ("all", one + more)):
        if gaps:
            p50, p99 = _pct(gaps, 50), _pct(gaps, 99)
            print(f"  {label}: {len(gaps)} gaps, ITL p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms ({p99 / p50:.2f}x)")
    for index, (times, tokens) in enumerate(zip(chunks, counts)):
        stretches: dict[int, list[tuple[float, int]]] = {}
        for (a, b), n in zip(zip(times, times[1:]), tokens[1:]):
            stretches.setdefault(int(a // 20) * 20, []).append((b - a, n))
        print(f"  stream {index} per 20 s (median gap ms / tokens a chunk): " + ", ".join(
            f"{t}: {_pct([g for g, _ in v], 50) * 1000:.0f}/{sum(n for _, n in v) / len(v):.1f}"
            for t, v in sorted(stretches.items())))


if __name__ == "__main__":
    main()
