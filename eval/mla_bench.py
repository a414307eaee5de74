"""Absorbed against naive decode for multi-head latent attention at DeepSeek-V2-Lite's shapes.

One attention layer (hidden 2048, 16 heads, latent rank 512 + rope 64, nope 128, v 128) with random
bf16 weights and a latent cache holding `--contexts` tokens of random latents; each path decodes
one row per sequence over that context, in one process, alternating the two, best of `--repeats`:

    python -m specdec.eval.mla_bench --contexts 1024 8192 --threads 2

Prints ms a layer for each path and their ratio, and the cache's bytes a token (the latent's
against per-head keys and values). Nothing is downloaded; no model file is needed.
"""

from __future__ import annotations

import argparse
import time

import torch

V2_LITE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
               num_experts_per_tok=6, n_shared_experts=2, kv_lora_rank=512, q_lora_rank=None,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
               max_position_embeddings=16384)


def _layer(dtype: torch.dtype):
    from transformers import DeepseekV2Config

    from specdec.target.config import ModelConfig
    from specdec.target.mla import LatentAttention

    config = ModelConfig.from_hf(DeepseekV2Config(**V2_LITE))
    torch.manual_seed(0)
    layer = LatentAttention(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    return config, layer.to(dtype).eval()


def run(contexts: list[int], batch: int, repeats: int, block_size: int = 16) -> list[dict]:
    from specdec.cache import BlockPool, BlockTable, KVCacheSpec, PagedKVCache, build_attention_metadata
    from specdec.target import mla
    from specdec.target.rope import RotaryEmbedding

    dtype = torch.bfloat16
    config, layer = _layer(dtype)
    m = config.mla
    rows, threshold_before = [], mla.NAIVE_MIN_QUERY_LEN
    for ctx in contexts:
        blocks = batch * (-(-(ctx + 1) // block_size))
        spec = KVCacheSpec(1, 1, m.latent_dim, block_size, dtype, latent_rank=m.kv_lora_rank)
        cache = PagedKVCache(spec, blocks)
        cache.kv.normal_(0, 1)
        pool = BlockPool(blocks)
        tables = [BlockTable(pool, block_size) for _ in range(batch)]
        for t in tables:
            t.ensure_slots(ctx + 1)
        meta = build_attention_metadata(tables, [ctx] * batch, [ctx + 1] * batch, "cpu")
        rotary = RotaryEmbedding(config.hf_config, config.head_dim, ctx + 1)
        x = torch.randn(batch, config.hidden_size).to(dtype)
        rotation = rotary(torch.full((batch,), ctx), dtype)
        times = {"absorbed": [], "naive": []}
        with torch.inference_mode():
            for _ in range(repeats):
                for path, threshold in (("absorbed", 1 << 30), ("naive", 1)):
                    mla.NAIVE_MIN_QUERY_LEN = threshold
                    meta.scratch.clear()
                    start = time.perf_counter()
                    layer(x, rotation, cache, 0, meta)
                    times[path].append(time.perf_counter() - start)
        mla.NAIVE_MIN_QUERY_LEN = threshold_before
        absorbed, naive = min(times["absorbed"]), min(times["naive"])
        rows.append({"context": ctx, "batch": batch, "absorbed_ms": 1e3 * absorbed, "naive_ms": 1e3 * naive,
                     "naive_over_absorbed": naive / absorbed})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding one row each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdec.native import describe_simd

    layers, heads = 27, 16
    latent = (512 + 64) * layers * 2
    per_head = heads * (192 + 128) * layers * 2
    print(f"DeepSeek-V2-Lite KV bytes a token (bf16, {layers} layers): latent {latent:,}, per-head K and V "
          f"{per_head:,} ({per_head / latent:.1f}x)")
    print(f"one layer, decode, {torch.get_num_threads()} threads, {describe_simd()}")
    print(f"{'context':>8} {'batch':>5} {'absorbed ms':>12} {'naive ms':>10} {'naive / absorbed':>17}")
    for r in run(args.contexts, args.batch, args.repeats):
        print(f"{r['context']:>8} {r['batch']:>5} {r['absorbed_ms']:>12.2f} {r['naive_ms']:>10.2f} "
              f"{r['naive_over_absorbed']:>16.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
