"""Tensor parallelism on paper: batch-1 decode time a token for N machines, from the weights each
reads and the all-reduces it makes (Megatron's split: 2 per layer, one hidden vector of fp32 a
row; a ring all-reduce: 2 (N-1) messages of 2 (N-1)/N of the bytes). The LM head is split too.

    python docs/results/issue39/on_paper.py
"""

MODELS = {  # name: (GGUF Q4_K_M bytes, layers, hidden)
    "7B-shaped (Qwen2.5-7B: 28 layers, hidden 3584, 4.7 GB)": (4.68e9, 28, 3584),
    "70B-shaped (Llama-3-70B: 80 layers, hidden 8192, 42.5 GB)": (42.5e9, 80, 8192),
}
BANDWIDTH = 25e9  # bytes/s a machine reads its weights at (this host: 22-32 GB/s, 2 cores)
NETWORKS = {"1 GbE (50 us, 0.117 GB/s)": (50e-6, 0.117e9), "10 GbE (20 us, 1.17 GB/s)": (20e-6, 1.17e9),
            "25 GbE RDMA (5 us, 2.9 GB/s)": (5e-6, 2.9e9)}
MEMORY = 24e9  # a machine's memory: below this the model's share must fit


def token_ms(weights: float, layers: int, hidden: int, n: int, latency: float, wire: float, rows: int = 1) -> float:
    read = weights / n / BANDWIDTH
    if n == 1:
        return read * 1e3
    per_call = 2 * (n - 1) * latency + 2 * (n - 1) / n * hidden * 4 * rows / wire
    return (read + (2 * layers + 1) * per_call) * 1e3


def main() -> None:
    for model, (weights, layers, hidden) in MODELS.items():
        print(f"\n{model}: ms a token (tok/s), batch 1; in brackets a verify window of 6 rows")
        print("| machines | " + " | ".join(NETWORKS) + " |")
        print("|---|" + "---|" * len(NETWORKS))
        for n in (1, 2, 4, 8):
            fits = weights / n < MEMORY * 0.9
            cells = []
            for latency, wire in NETWORKS.values():
                one, six = token_ms(weights, layers, hidden, n, latency, wire), token_ms(weights, layers, hidden, n, latency, wire, 6)
                cells.append(f"{one:.0f} ({1e3 / one:.1f}) [{six:.0f}]" if fits else "does not fit")
            print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
