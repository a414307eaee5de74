"""Where the running streams' longest gaps fall, per layout, against the long prompts' arrivals and
first tokens (the raw timeline `specdec bench serve --pd` records in pd.json).

    python docs/results/issue36/timeline.py docs/results/issue36/sitting-b/pd.json [N]
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


if __name__ == "__main__":
    main()
