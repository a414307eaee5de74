"""`response_format` through a running `specdec serve` with the official openai client: each
(prompt, schema) pair streamed and not, every answer validated with jsonschema.

    specdec serve --port 8765 &
    python docs/results/issue16/serve_check.py --url http://127.0.0.1:8765/v1 [--limit 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).parent))
from bench_forced import WORKLOAD  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8765/v1")
    parser.add_argument("--limit", type=int, default=len(WORKLOAD))
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    valid = total = 0
    for prompt, schema in WORKLOAD[: args.limit]:
        for stream in (False, True):
            kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                          temperature=0, response_format={"type": "json_schema", "json_schema": {
                              "name": "answer", "schema": schema, "strict": True}})
            start = time.perf_counter()
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kwargs))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
            else:
                out = client.chat.completions.create(**kwargs)
                text, finish = out.choices[0].message.content, out.choices[0].finish_reason
            total += 1
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
                verdict = "valid"
            except (json.JSONDecodeError, jsonschema.ValidationError) as error:
                verdict = f"INVALID ({type(error).__name__})"
            print(f"stream={stream} finish={finish} {time.perf_counter() - start:.1f}s {verdict}: {text}")
    print(f"{valid}/{total} answers validate")


if __name__ == "__main__":
    main()
