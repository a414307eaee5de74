"""Engine configuration: a plain value, checked on construction.

What depends on the machine (the device of "auto", the quantization of None) is resolved by the
loader (`specdec.engine_parts.resolve_config`); nothing here builds or loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.target.quant.modes import QUANT_MODES

PROPOSERS = ("draft", "hybrid", "ngram", "recycling", "none")
SPEC_TREES = ("auto", "on", "off")
KV_DTYPES = ("auto", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "c", "triton")
CUDA_GRAPHS = ("auto", "on", "off")
PARALLEL_RANKS = ("local", "ray")  # where a parallel target's other ranks run (`specdec.parallel.launch`)
PARALLEL_PLACEMENTS = ("pack", "spread")


@dataclass
class EngineConfig:
    """Everything that shapes an engine; validated on construction.

    `target` / `draft` are model specs (a local HF folder, a .gguf file, a hub id, or the embedded
    default pair `default-target` / `default-draft`). `proposer="none"` is plain decoding.
    """

    target: str = "default-target"
    draft: str | None = "default-draft"
    proposer: str = "hybrid"
    # The most drafted per step (with adaptive_k, a cap). 5: on 10 HumanEval prompts (greedy, 128
    # tokens) caps 4 / 5 / 8 gave 39.7 / 39.7 / 37.7 tok/s (means of 3-4 runs, this CPU).
    num_speculative_tokens: int = 5
    # A token tree's draft nodes at most (`proposer="recycling"`: Token Recycling's trees, issue
    # 62; with `spec_tree="on"` the draft model's); num_speculative_tokens bounds its depth.
    tree_rows: int = 8
    # The draft model proposes token trees (`draft.model_tree`: EAGLE-2-style, the nodes of highest
    # path probability) instead of chains (proposers draft and hybrid): "on", trees of `tree_rows`
    # nodes; "auto" (with adaptive_k), priced trees: a node joins only where its measured chance of
    # being kept pays for its verify row (`SpeculationPolicy.node_gain`), so where rows cost
    # little trees grow wide and where they cost much they shrink to the chain; "off", chains.
    spec_tree: str = "off"
    adaptive_k: bool = True  # choose each step's k from measured costs and acceptance
    # With adaptive_k, a sequence stops drafting once the draft's probability of its drafts so far
    # falls below this (0: never; see DraftModelProposer); the policy then only decides whether
    # to draft, and the cap (num_speculative_tokens) bounds how far.
    draft_stop_confidence: float = 0.5
    # With adaptive_k, even steps: a drafting step expected within 1.5x the batch's plain step
    # (`planner.STEADY_STEP_RATIO`), no early stop, and the batch keeps its k until another promises
    # 15% more tokens per second (`planner.STEADY_MARGIN`), so the streams' gaps between chunks stay
    # even. A decode replica's default under prefill/decode disaggregation (`--decode-steps`).
    steady_steps: bool = False
    # Map the KV pools' whole memory at load (`PagedKVCache.make_resident`) instead of page by page
    # as blocks are first written: a PD decode replica's default, which imports a handed-over
    # prompt's blocks in one burst (63 MB in 0.25 s on fresh pages, 0.02 s on mapped ones here).
    kv_resident: bool = False
    # The draft's LM head over a frequent vocabulary (`draft.vocab`: FR-Spec, lossless): a number of
    # ids (rounded up to 16), "full", or "auto": `draft.vocab.DEFAULT_SIZE` ids where a shipped
    # frequency table matches the tokenizer, else full.
    draft_vocab: int | str = "auto"
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    # both caches together, split so both hold the same tokens (the default pair: ~40 KB a token,
    # so 1 GiB holds ~26k; a serving process then stays under 4 GB once every block was used)
    kv_cache_memory_gib: float = 1.0
    kv_dtype: str = "auto"
    # Paged attention: "auto" (the C kernel on the CPU where it fits, Triton on CUDA, else the torch
    # reference), "torch" (the reference everywhere), "c" (the C kernel where it fits, never
    # Triton), "triton" (the Triton kernel on every layer: on CUDA, or on the CPU under
    # TRITON_INTERPRET=1, which is how CI runs the GPU path; `cache.attention.check_backend`).
    attention_backend: str = "auto"
    # CUDA graphs of the decode and verify steps (`target.static_step`): "auto" captures one graph
    # per token bucket on CUDA and is off elsewhere; "on" is refused without CUDA; "off" runs
    # every step eagerly. `bucketed_steps` runs the same padded steps without capture (the CPU's
    # tests of the captured path; on CUDA the eager baseline of a graph's figure); None: where graphs run.
    cuda_graphs: str = "auto"
    bucketed_steps: bool | None = None
    num_blocks: int | None = None  # overrides the memory budget (both pools get this many)
    max_num_seqs: int = 16
    max_model_len: int | None = None
    # Automatic prefix caching in both pools: full blocks keyed by their token prefix, kept after
    # their request ends, evicted least recently used when a block is needed.
    enable_prefix_caching: bool = True
    # Chunked prefill: while any sequence decodes, prompts are prefilled in chunks that ride in
    # the same steps, so no running stream waits for a whole prompt. None (default): each chunk
    # is sized from measured step times so that a step takes at most `prefill_gap_ratio` times a
    # plain decode step (`adaptive.ChunkSizer`). A number: a fixed cap on a step's target rows
    # (decode and verify rows included; a chunk takes the rest, at least MIN_PREFILL_CHUNK).
    max_num_batched_tokens: int | None = None
    prefill_gap_ratio: float = 2.5
    # With nothing decoding, prompts are prefilled in chunks of up to this many tokens.
    max_prefill_chunk: int = 2048
    # CPU quantization (`target.quant.formats.MODES`); None: the loader picks per model
    # (`engine_parts.resolve_config`). On the CPU in bfloat16, where specdec's C kernel runs
    # (`target.quant.qgemm`: AVX-512 VNNI, AVX-VNNI or AVX2, bitwise the same), the target takes "gguf"
    # (a GGUF's quantized tensors read as stored, the file's bytes and values,
    # activations int8 per 256 inputs for the k-quants, per 32 for the others; anything else as "w4a8-auto": int4 where on the 4-bit grid, else int8,
    # activations int8 per group of 32), and so does a GGUF draft (`engine_parts.draft_default`);
    # a draft that is no GGUF takes "w4a8" (int4 everywhere; a draft only proposes, so its rounding
    # cannot change the output distribution). Without the kernel: target "w8a8" (fbgemm int8 after SmoothQuant), draft
    # "int4+w8a8" (torch's int4 kernel plus an int8 copy for windows of 5+ rows). Elsewhere "none".
    target_quant: str | None = None
    draft_quant: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    # The target split over processes (`specdec.parallel`; the draft stays whole on the driver):
    # tensor parallel (each rank its heads and its share of the MLP, an all-reduce after o_proj
    # and after down_proj) or pipeline parallel (each stage a range of layers), not both. The CPU
    # only. `tensor_parallel_exact`: o_proj and down_proj split by output rows with their inputs
    # gathered, so that every value is one process's (the same tokens; ~7x the bytes on the wire
    # a layer), else by input columns with the ranks' partial sums added (fewer bytes, not
    # bitwise). `parallel_ranks`: "local" spawns the ranks on this machine; "ray" places them as Ray
    # actors (the cluster at RAY_ADDRESS, or the placement group of the Serve replica this runs
    # in), `parallel_placement` "pack" (one machine where they fit) or "spread". A rank that dies
    # or does not answer within `parallel_timeout_s` ends the engine (`RankFailure`).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    parallel_timeout_s: float = 60.0
    tensor_parallel_exact: bool = True
    parallel_ranks: str = "local"
    parallel_placement: str = "pack"

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.uses_draft_model and not self.draft:
            raise ValueError(f"proposer {self.proposer!r} needs a draft model")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 0..16, got {self.num_speculative_tokens}")
        if self.spec_tree not in SPEC_TREES:
            raise ValueError(f"spec_tree must be one of {SPEC_TREES}, got {self.spec_tree!r}")
        if self.spec_tree == "on" and not self.uses_draft_model:
            raise ValueError(f"spec_tree 'on' grows the draft model's trees: proposer 'draft' or 'hybrid', "
                             f"got {self.proposer!r} (proposer 'recycling' always proposes trees)")
        if self.trees and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("token trees (proposer 'recycling', spec_tree 'on') run on a one-process target for "
                             "now: set tensor_parallel_size and pipeline_parallel_size to 1, or propose chains")
        if not 1 <= self.tree_rows <= 63:
            raise ValueError(f"tree_rows must be in 1..63 (a tree window holds 64 rows), got {self.tree_rows}")
        if not 0.0 <= self.draft_stop_confidence < 1.0:
            raise ValueError(f"draft_stop_confidence must be in [0, 1), got {self.draft_stop_confidence}")
        if self.draft_vocab not in ("auto", "full") and not (isinstance(self.draft_vocab, int) and self.draft_vocab > 0):
            raise ValueError(f"draft_vocab must be a positive number of ids, 'full' or 'auto', got {self.draft_vocab!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPHS}, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.resolved_device() != "cuda":
            raise ValueError(f"cuda_graphs 'on' needs a CUDA device; this engine runs on {self.resolved_device()} "
                             "(--cuda-graphs auto is off there)")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        for name in ("target_quant", "draft_quant"):
            if getattr(self, name) not in (None, *QUANT_MODES):
                raise ValueError(f"{name} must be one of {QUANT_MODES}, got {getattr(self, name)!r}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be positive")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be positive, got {self.max_prefill_chunk}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not 1 <= getattr(self, name) <= 32:
                raise ValueError(f"{name} must be in 1..32, got {getattr(self, name)}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported yet: set one of "
                             "tensor_parallel_size / pipeline_parallel_size to 1")
        if self.parallel_ranks not in PARALLEL_RANKS:
            raise ValueError(f"parallel_ranks must be one of {PARALLEL_RANKS}, got {self.parallel_ranks!r}")
        if self.parallel_placement not in PARALLEL_PLACEMENTS:
            raise ValueError(f"parallel_placement must be one of {PARALLEL_PLACEMENTS}, got {self.parallel_placement!r}")
        if not self.parallel_timeout_s > 0:
            raise ValueError(f"parallel_timeout_s must be positive, got {self.parallel_timeout_s}")
        if not self.prefill_gap_ratio > 1:
            raise ValueError(f"prefill_gap_ratio must be > 1, got {self.prefill_gap_ratio}")

    @property
    def trees(self) -> bool:
        """Whether the proposer proposes token trees (recycling, or the draft model with spec_tree on)."""
        return self.proposer == "recycling" or self.draft_trees

    @property
    def draft_trees(self) -> bool:
        """Whether the draft model proposes trees: spec_tree "on", or "auto" under adaptive_k on a
        one-process target."""
        on = self.spec_tree == "on" or (self.spec_tree == "auto" and self.adaptive_k and self.parallel_size == 1)
        return on and self.uses_draft_model and self.speculative

    @property
    def uses_draft_model(self) -> bool:
        return self.proposer in ("draft", "hybrid")

    @property
    def parallel_size(self) -> int:
        """Processes the target runs in (1: this one)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def speculative(self) -> bool:
        return self.proposer != "none" and self.num_speculative_tokens > 0

    @property
    def static_steps(self) -> str:
        """The runners' `static_steps`: "graphs" (CUDA, graphs on), "eager" (padded steps, no
        capture: `bucketed_steps`) or "off"."""
        graphs = self.cuda_graphs != "off" and self.resolved_device() == "cuda"
        bucketed = graphs if self.bucketed_steps is None else self.bucketed_steps
        return "graphs" if graphs and bucketed else "eager" if bucketed else "off"

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
