"""Issue 15's end-to-end checks through `specdec serve` with the official openai client.

    python docs/results/v0.8.0/issue15_e2e.py PORT OUT.json

against a running `specdec serve --port PORT` (default pair). Writes every answer to OUT.json and
prints the checks: logprobs with speculation vs a `num_speculative_tokens: 0` request (streamed
and not), frequency_penalty on a "repeat this word" prompt, logit_bias +100, n=2, an unknown field.
"""

import json
import sys

import httpx
from openai import BadRequestError, OpenAI

port, out_path = int(sys.argv[1]), sys.argv[2]
base = f"http://127.0.0.1:{port}"
client = OpenAI(base_url=f"{base}/v1", api_key="none")
model = client.models.list().data[0].id
results: dict = {}
ASK = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def chat_logprobs(k: int | None, stream: bool) -> list[tuple[str, float, list]]:
    extra = {} if k is None else {"num_speculative_tokens": k}
    kw = dict(model=model, messages=ASK, max_tokens=64, temperature=0, logprobs=True, top_logprobs=3,
              extra_body=extra)
    entries = []
    if stream:
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                entries += chunk.choices[0].logprobs.content
    else:
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


for stream in (False, True):
    spec, plain = chat_logprobs(None, stream), chat_logprobs(0, stream)
    # bf16 forwards are not batch-invariant on every CPU path: a verify window of k+1 rows and a
    # one-row decode may round differently, and greedy answers can part where two tokens nearly
    # tie. Compare the logprobs over the common prefix (the same tokens at the same prefix).
    common = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a[0] != b[0]), min(len(spec), len(plain)))
    diffs = [abs(a[1] - b[1]) for a, b in zip(spec[:common], plain[:common])]
    top_diffs = [abs(x[1] - y[1]) for a, b in zip(spec[:common], plain[:common])
                 for x, y in zip(a[2], b[2]) if x[0] == y[0]]
    diverged = None if common == len(spec) == len(plain) else {
        "at": common, "speculative": spec[common][:2], "k0": plain[common][:2],
        "k0_top": plain[common][2], "speculative_top": spec[common][2]}
    results[f"logprobs_stream={stream}"] = {
        "speculative": spec, "k0": plain, "common_prefix": common, "diverged": diverged,
        "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs),
        "max_abs_diff_top": max(top_diffs),
    }
    print(f"logprobs stream={stream}: {len(spec)} tokens, the same for the first {common}; over those, "
          f"max |diff| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.5f}, top-3 max {max(top_diffs):.4f}"
          + (f"; parted at {common}: {diverged['speculative']} vs {diverged['k0']}" if diverged else ""))

REPEAT = [{"role": "user", "content": "Repeat the word banana 40 times, separated by spaces. Output nothing else."}]
for penalty in (0.0, 2.0):
    r = client.chat.completions.create(model=model, messages=REPEAT, max_tokens=80, temperature=0,
                                       frequency_penalty=penalty)
    text = r.choices[0].message.content
    results[f"repeat_frequency_penalty={penalty}"] = text
    print(f"frequency_penalty={penalty}: 'banana' x{text.lower().count('banana')}: {text[:100]!r}")

token = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": " Zebra"}).json()["tokens"][0]
for bias in (None, {str(token): 100}):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=5, temperature=0, logit_bias=bias,
                                       logprobs=True)
    first = r.choices[0].logprobs.content[0].token
    results[f"logit_bias={bias}"] = r.choices[0].message.content
    print(f"logit_bias {bias}: first token {first!r}, answer {r.choices[0].message.content!r}")

r = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0.8, seed=1, n=2)
results["n=2"] = [c.message.content for c in r.choices]
print(f"n=2: {len(r.choices)} choices, indices {[c.index for c in r.choices]}, usage {r.usage.completion_tokens} "
      f"completion tokens, differ: {r.choices[0].message.content != r.choices[1].message.content}")

try:
    client.chat.completions.create(model=model, messages=ASK, max_tokens=4, extra_body={"mirostat_tau": 5})
    print("unknown field: accepted (WRONG)")
except BadRequestError as exc:
    results["unknown_field"] = exc.body
    print(f"unknown field: {exc.status_code} {exc.body}")

with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
