"""The command-line flags shared by the commands that build an engine or sample (generate, chat,
serve, eval, bench), and their translation into EngineConfig / SamplingParams."""

from __future__ import annotations

import argparse

from specdec.config import PARALLEL_PLACEMENTS, PARALLEL_RANKS, QUANT_MODES, EngineConfig
from specdec.sampling_params import SamplingParams


def add_warmup_arg(p: argparse.ArgumentParser) -> None:
    """`--no-warmup` for the commands that warm the engine up before their first request."""
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up (one short greedy and one sampled request through both "
                        "models after loading); the first request is then 2-4x slower")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that shape the engine; shared by every subcommand that builds one."""
    g = p.add_argument_group("engine")
    g.add_argument("--target", default="default-target",
                   help="target model: HF folder, .gguf file, hub id (default: Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("--draft", default="default-draft",
                   help="draft model, same forms (default: Qwen2.5-Coder-0.5B-Instruct)")
    g.add_argument("--proposer", choices=["draft", "hybrid", "ngram", "recycling"], default="hybrid",
                   help="draft model; hybrid: prompt lookup where a 2-gram repeats, else the draft "
                        "model; ngram: prompt lookup only (no model); recycling: a token tree from the "
                        "target's own earlier top candidates and prompt lookup (no model)")
    g.add_argument("--spec-tree", choices=["auto", "on", "off"], default=EngineConfig.spec_tree,
                   help="the draft model proposes token trees (the nodes of highest path probability, "
                        "verified in one pass) instead of chains (proposers draft and hybrid): on, trees of "
                        "--tree-rows nodes; auto, each node only where its measured chance of being kept pays "
                        f"for its verify row (adaptive k); off, chains (default {EngineConfig.spec_tree})")
    g.add_argument("--tree-rows", type=int, default=EngineConfig.tree_rows, metavar="N",
                   help="with --proposer recycling or --spec-tree on, a token tree's draft nodes at most (-k bounds its depth; "
                        f"default {EngineConfig.tree_rows})")
    g.add_argument("--no-speculation", action="store_true", help="plain target-only decoding")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens,
                   help="most draft tokens per step (exactly this many with --fixed-k; default: "
                        f"{EngineConfig.num_speculative_tokens})")
    g.add_argument("--fixed-k", action="store_true",
                   help="always draft k tokens instead of choosing k per step from measured costs "
                        "and acceptance (makes seeded sampling reproducible token for token)")
    g.add_argument("--draft-stop-confidence", type=float, default=EngineConfig.draft_stop_confidence, metavar="P",
                   help="with adaptive k, a sequence stops drafting once the draft's probability "
                        "of its drafts so far falls below P (0: never)")
    g.add_argument("--steady-steps", action="store_true",
                   help="with adaptive k: draft only where a step stays within 1.5x a plain one, no early "
                        "stop, k changes only for a 15%% gain, so the streams' gaps between chunks stay even "
                        "(a PD decode replica's default)")
    g.add_argument("--draft-vocab", type=_draft_vocab, default="auto", metavar="N|full|auto",
                   help="the draft's LM head over the N most frequent ids (lossless: the target "
                        "verifies every token); auto: 32768 where a frequency table ships for the "
                        "tokenizer (the default pair's does), else full")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB",
                   help="KV cache budget for both models together, in GiB (default 1: ~26k tokens of the "
                        "default pair; on the CPU its pages are taken as tokens arrive)")
    g.add_argument("--attention-backend", choices=["auto", "torch", "c", "triton"], default="auto",
                   help="paged attention: auto (the C kernel on the CPU, Triton on CUDA), torch (the "
                        "reference), c, or triton (on the CPU only under TRITON_INTERPRET=1: slow, for tests)")
    g.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="CUDA graphs of the decode and verify steps, one per token bucket: auto (on CUDA; "
                        "off elsewhere), on (refused without CUDA), off (every step eager)")
    g.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto",
                   help="KV cache dtype: the model's, or fp8 (e4m3)")
    g.add_argument("--target-quant", choices=QUANT_MODES, default=None,
                   help="CPU quantization of the target (auto: weight-only int4 where the weights "
                        "sit on a 4-bit grid, as GGUF Q4_K does, else dense; int4: every linear; "
                        "w8a8: int8 weights and activations, smoothed, cost flat in the number of "
                        "verified tokens; w4a8-auto: int4 where on the 4-bit grid, else int8, "
                        "activations int8 per group of 32, on specdec's C kernel (AVX2 or better); w4a8: "
                        "int4 everywhere on that kernel; gguf: a GGUF's Q4_K / Q5_K / Q6_K / Q3_K / Q2_K / IQ4_XS / Q4_0 / Q4_1 / Q5_0 / IQ4_NL / MXFP4 / Q8_0 / F16 / BF16 tensors read as stored "
                        "on that kernel, w4a8-auto for the rest); cached after first use where anything "
                        "was re-quantized. Default, on the CPU in bf16 where the kernel runs: gguf (a target that is "
                        "no GGUF: w4a8-auto); without the kernel w8a8; elsewhere none")
    g.add_argument("--draft-quant", choices=QUANT_MODES, default=None,
                   help="the same for the draft model. Default: gguf for a GGUF draft where the kernel runs, "
                        "else w4a8; without the kernel int4+w8a8; elsewhere none")
    g.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV of earlier requests' identical prompt prefixes")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="a fixed cap on the tokens of a step while any stream decodes (a long prompt "
                        "is prefilled in chunks beside the running streams). Default: chunks sized "
                        "from measured step times to keep steps within --prefill-gap-ratio")
    g.add_argument("--prefill-gap-ratio", type=float, default=EngineConfig.prefill_gap_ratio, metavar="R",
                   help="without --max-num-batched-tokens: a step carrying a prefill chunk takes at "
                        "most R times a plain decode step (larger: prompts start sooner, streams "
                        f"stutter more; default {EngineConfig.prefill_gap_ratio})")
    g.add_argument("--max-prefill-chunk", type=int, default=EngineConfig.max_prefill_chunk, metavar="N",
                   help="prefill chunk when no stream is decoding (default: "
                        f"{EngineConfig.max_prefill_chunk})")
    g.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="split the target over N processes by heads and MLP width "
                        "(each reads 1/N of its layers' weights; an all-reduce after o_proj and down_proj; "
                        "the CPU's cores are shared between them). The draft stays whole. CPU only")
    g.add_argument("--pipeline-parallel-size", "--pp", type=int, default=1, metavar="M",
                   help="split the target over M processes by layer ranges, run one after the other "
                        "(memory per process, not speed). Not together with --tensor-parallel-size")
    g.add_argument("--parallel-timeout", type=float, default=EngineConfig.parallel_timeout_s, metavar="S",
                   help="a rank that does not answer within S seconds ends the engine with an error "
                        f"(default {EngineConfig.parallel_timeout_s:g})")
    g.add_argument("--tensor-parallel-exact", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.tensor_parallel_exact,
                   help="split o_proj and down_proj by output rows with their inputs gathered, so that "
                        "the tokens are one process's, bit for bit (default); --no-tensor-parallel-exact "
                        "splits them by inputs and adds the ranks' partial sums: ~7x fewer bytes a layer "
                        "between ranks (for ranks on a slow network), tokens that may differ after a near-tie")
    g.add_argument("--parallel-ranks", choices=PARALLEL_RANKS, default=None,
                   help="where the other ranks run: 'local' processes on this machine, or 'ray' actors "
                        "on the Ray cluster at $RAY_ADDRESS (a local Ray without it; the model folder at "
                        "the same path on every machine). Default: local; with serve --replicas, ray "
                        "(each replica and its ranks one placement group)")
    g.add_argument("--parallel-placement", choices=PARALLEL_PLACEMENTS, default=EngineConfig.parallel_placement,
                   help="with Ray ranks: 'pack' them on one machine where they fit (the all-reduce through "
                        "memory) or 'spread' them over machines (through gloo) (default: "
                        f"{EngineConfig.parallel_placement})")


def _draft_vocab(value: str) -> int | str:
    if value in ("auto", "full"):
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of ids, 'full' or 'auto', got {value!r}")
    return size


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        target=args.target,
        draft=args.draft,
        proposer="none" if args.no_speculation else args.proposer,
        num_speculative_tokens=args.num_speculative_tokens,
        tree_rows=args.tree_rows,
        spec_tree=args.spec_tree,
        adaptive_k=not args.fixed_k,
        draft_stop_confidence=args.draft_stop_confidence,
        steady_steps=args.steady_steps,
        draft_vocab=args.draft_vocab,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        kv_dtype=args.kv_dtype,
        attention_backend=args.attention_backend,
        cuda_graphs=args.cuda_graphs,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        target_quant=args.target_quant,
        draft_quant=args.draft_quant,
        enable_prefix_caching=args.prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_gap_ratio=args.prefill_gap_ratio,
        max_prefill_chunk=args.max_prefill_chunk,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        parallel_timeout_s=args.parallel_timeout,
        tensor_parallel_exact=args.tensor_parallel_exact,
        parallel_ranks=args.parallel_ranks or ("ray" if getattr(args, "replicas", None) else "local"),
        parallel_placement=args.parallel_placement,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top token's probability")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, -2..2")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2..2")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's, > 0 (1 = off)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=args.stop, seed=args.seed, ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
