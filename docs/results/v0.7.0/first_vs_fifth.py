"""Start `specdec serve` (extra flags from argv), wait for /health 200, then time 5 identical
streamed chat requests (TTFT, total) and 3 non-streamed 128-token answers (tok/s).
Usage: python first_vs_fifth.py PORT [--salted] -- [serve flags...]"""
import json, subprocess, sys, time, uuid
import httpx
from openai import OpenAI

port = int(sys.argv[1]); salted = "--salted" in sys.argv
flags = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
log = open(f"/tmp/s7/serve-{port}.log", "w")
t_start = time.perf_counter()
proc = subprocess.Popen(["specdec", "serve", "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT)
try:
    while True:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            sys.exit("server died")
        time.sleep(0.2)
    ready_s = time.perf_counter() - t_start
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
    msgs = [{"role": "user", "content": "Say hello in French, then count to five."}]
    rows = []
    for i in range(5):
        extra = {"cache_salt": uuid.uuid4().hex} if salted else {}
        t0 = time.perf_counter(); ttft = None; n = 0
        body = {"model": "default-target", "messages": msgs, "stream": True, "temperature": 0, "max_tokens": 48, **extra}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(c.get("delta", {}).get("content") for c in json.loads(line[6:]).get("choices", [])):
                    ttft = ttft or time.perf_counter() - t0; n += 1
        rows.append({"i": i + 1, "ttft_s": round(ttft, 3), "total_s": round(time.perf_counter() - t0, 3)})
    tps = []
    for i in range(3):
        extra = {"cache_salt": uuid.uuid4().hex} if salted else {}
        t0 = time.perf_counter()
        out = client.chat.completions.create(model="default-target", temperature=0, max_tokens=128, extra_body=extra,
            messages=[{"role": "user", "content": f"Write a Python function that merges two sorted lists. ({i})"}])
        tps.append(round(out.usage.completion_tokens / (time.perf_counter() - t0), 2))
    print(json.dumps({"flags": flags, "salted": salted, "ready_s": round(ready_s, 1), "stream": rows,
                      "first_over_fifth_ttft": round(rows[0]["ttft_s"] / rows[4]["ttft_s"], 2),
                      "nonstream_tok_s": tps}))
finally:
    proc.terminate(); proc.wait(30)
