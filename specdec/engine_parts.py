"""From an `EngineConfig` to the engine's parts: models, tokenizer and runners with sized KV caches.

The config is a plain value; what depends on the machine (the device of `"auto"`, the
quantization of `None`, which needs to know whether the C kernel builds here) is resolved here,
by `resolve_config`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from specdec import native
from specdec.cache import PagedKVCache, cpu_attention
from specdec.config import EngineConfig
from specdec.draft import vocab
from specdec.target.default_pair import finish_check
from specdec.target.family_quant import family_quant
from specdec.target.model_files import DEFAULT_DRAFT_SPEC, DEFAULT_TARGET_SPEC, resolve_model
from specdec.target.model_weights import load_model, parse_dtype
from specdec.target.quant import decoder_stack, int4, qgemm
from specdec.target.quant.qgemm import load_qgemm
from specdec.target.runner import ModelRunner
from specdec.target.tokenizer import load_tokenizer, same_tokenizer_files

GIB = 1 << 30
# How many ids a draft's and a target's vocabularies may differ by when one only pads the other
# (Qwen2.5: 152,064 - 151,936 = 128); a larger gap is another tokenizer, not padding.
MAX_VOCAB_PADDING = 512
_SHOWN_IDS = 5  # differing ids named in a mismatch message


class TokenizerMismatchError(ValueError):
    """Draft and target do not share a tokenizer, so draft tokens mean nothing to the target."""


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with the quantization of each model chosen where it is None.

    On the CPU in bfloat16, where the C kernel runs (`quant.qgemm`: AVX2 or better, built here
    once, ~2 s), the target takes "gguf" (a GGUF's quantized blocks as stored, "w4a8-auto" for
    anything else) and the draft `draft_default`; without the kernel "w8a8" and
    "int4+w8a8"; elsewhere "none" (see `EngineConfig.target_quant`). Families the quantized
    path does not implement (Gemma, Phi-3) take "none", logged (`family_quant`).
    """
    target, draft = "none", "none"
    both_chosen = config.target_quant is not None and config.draft_quant is not None
    if not both_chosen and config.dtype == "bfloat16" and config.resolved_device() == "cpu":
        kernel = load_qgemm() is not None
        target, draft = ("gguf", draft_default(config.draft)) if kernel else ("w8a8", "int4+w8a8")
    return dataclasses.replace(
        config,
        target_quant=family_quant(config.target, target, config.target_quant),
        # no draft model (`draft=None`, a model-free proposer or none): its quantization is moot
        draft_quant=family_quant(config.draft, draft, config.draft_quant) if config.draft else (config.draft_quant or draft),
    )


def proposer_for_target(config: EngineConfig) -> tuple[EngineConfig, str | None]:
    """`config` with prompt lookup in place of the default draft where that draft cannot serve the
    target, and why (None: `config` as given). The default draft is Qwen2.5's: a target of another
    family given without `--draft` decodes with prompt lookup (`proposer="ngram"`, no draft model)
    rather than failing on the tokenizers; a draft the user names is still checked
    (`TokenizerMismatchError`)."""
    if not (config.speculative and config.uses_draft_model and config.draft == DEFAULT_DRAFT_SPEC
            and config.target != DEFAULT_TARGET_SPEC):
        return config, None
    from specdec.target.default_pair import ModelsNotInstalledError

    target_dir = resolve_model(config.target, wait_check=False)
    try:
        draft_dir = resolve_model(DEFAULT_DRAFT_SPEC, wait_check=False)
    except ModelsNotInstalledError:
        why = "the default draft is not installed"
    else:
        if same_tokenizer_files(target_dir, draft_dir):
            return config, None
        try:
            check_same_tokenizer(load_tokenizer(target_dir), load_tokenizer(draft_dir), config)
            return config, None
        except TokenizerMismatchError:
            why = "the default draft (Qwen2.5) has another tokenizer"
    note = f"prompt lookup: {why}; --draft a model with this target's tokenizer"
    return dataclasses.replace(config, proposer="ngram", draft=None), note


def draft_default(spec: str | None) -> str:
    """The draft's quantization where the kernel runs: a GGUF draft's blocks as stored ("gguf": the
    embedded default or a .gguf file), at every level: the file's exact weights, nothing
    re-quantized on a first load, and as fast as its int4 re-quantization (v0.21.0 at AVX-512
    VNNI: HumanEval 0.95-1.01x, ShareGPT 0.99x; v0.21.1 at AVX2, with Q5_0's 3-row passes:
    HumanEval 1.00 / 0.94x, ShareGPT 1.07 / 1.01x, `git show 7336cd4c7a51:docs/results/issue38/draft_quant_ab.sh`);
    "w4a8" for any draft that is not a GGUF."""
    gguf = spec == DEFAULT_DRAFT_SPEC or str(spec or "").lower().endswith(".gguf")
    return "gguf" if gguf else "w4a8"


def load_engine_parts(config: EngineConfig, log=None) -> tuple[Any, Any, Any]:
    """Resolve and load the target, the draft (when the draft proposer is used) and the tokenizer."""
    t0 = time.perf_counter()
    if config.resolved_device() == "cpu":  # compilers on the other core while this one reads
        native.prebuild([qgemm.kernel(), decoder_stack.kernel(), cpu_attention.kernel(), int4.QUANTIZER])
    config = resolve_config(config)
    dtype, device = parse_dtype(config.dtype), config.resolved_device()
    # Both folders first: a default model's first sha256 check then runs in the background while
    # the models load (disk reads under CPU work); settled before anything is served.
    target_dir = resolve_model(config.target, wait_check=False)
    uses_draft = config.speculative and config.uses_draft_model
    draft_dir = resolve_model(config.draft, wait_check=False) if uses_draft else None
    tokenizer = load_tokenizer(target_dir)
    group = start_rank_group(config, target_dir)  # None: one process; else its ranks load meanwhile
    try:
        target = load_model(target_dir, dtype, device, config.target_quant, None if group is None else group.load_part())
        if group is not None:
            group.shard(target)
            target.rank_group = group  # build_runners gives the target a ParallelRunner over it
    except BaseException:
        if group is not None:
            group.close()
        raise
    draft = None
    if draft_dir is not None:
        if not same_tokenizer_files(target_dir, draft_dir):
            check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), config)
        draft = load_model(draft_dir, dtype, device, config.draft_quant)
        restrict_draft_vocab(draft, tokenizer, config.draft_vocab, target.config.eos_token_ids, log)
    for folder in (target_dir, draft_dir):
        if folder is not None:
            finish_check(folder)
    if log:
        log(f"loaded models in {time.perf_counter() - t0:.1f}s; {native.describe_simd()}")
    return target, draft, tokenizer


def start_rank_group(config: EngineConfig, target_dir):
    """The target's other ranks, started (`specdec.parallel`), or None for one process."""
    if config.parallel_size == 1:
        return None
    if config.resolved_device() != "cpu":
        raise ValueError("tensor and pipeline parallelism run on the CPU only (gloo and a shared-memory "
                         "all-reduce); NCCL on CUDA is not built yet")
    from specdec.parallel.group import RankGroup

    return RankGroup.start(target_dir, config.dtype, config.target_quant, config.tensor_parallel_size,
                           config.pipeline_parallel_size, config.parallel_timeout_s, ranks=config.parallel_ranks,
                           placement=config.parallel_placement, exact=config.tensor_parallel_exact)


def restrict_draft_vocab(draft, tokenizer, size: int | str, stop_ids: list[int], log=None) -> None:
    """Cut the draft's LM head to `size` frequent ids (`draft.vocab`); "auto": the default size
    where a frequency table ships for this tokenizer, else nothing; "full": nothing."""
    if size == "full" or (size == "auto" and vocab.load_table(tokenizer) is None):
        return
    vocab_size = draft.config.vocab_size
    num_ids = vocab.DEFAULT_SIZE if size == "auto" else size
    num_ids = min(vocab_size, -(-num_ids // 16) * 16)  # whole tiles of 16 rows
    if num_ids >= vocab_size:
        return
    ids = vocab.frequent_ids(tokenizer, num_ids, list(stop_ids) + list(draft.config.eos_token_ids), vocab_size)
    vocab.restrict_head(draft, ids)
    if log:
        log(f"draft LM head over {num_ids} of {vocab_size} ids (draft_vocab={size})")


def check_same_tokenizer(target_tok: Any, draft_tok: Any, config: EngineConfig) -> None:
    """Refuse a draft whose tokens have other ids than the target's (`TokenizerMismatchError`).

    The two token -> id maps must be equal, or one a prefix of the other: the longer one may add
    up to `MAX_VOCAB_PADDING` tokens past the shorter one's last id (every other id the same).
    The message names the first ids that differ, e.g.
    "id 17 is 'ab' in the target, 'cd' in the draft; id 18 is ...".
    """
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab == draft_vocab:
        return
    target_ids, draft_ids = _tokens_by_id(target_vocab), _tokens_by_id(draft_vocab)
    end = min(max(target_ids, default=-1), max(draft_ids, default=-1)) + 1  # the shorter's end
    differing = [
        i for i in sorted(target_ids.keys() | draft_ids.keys())
        if i < end and target_ids.get(i) != draft_ids.get(i)
    ]
    extra = abs(len(target_ids) - len(draft_ids))
    if not differing and extra <= MAX_VOCAB_PADDING:
        return
    if differing:
        shown = "; ".join(
            f"id {i} is {target_ids.get(i)!r} in the target, {draft_ids.get(i)!r} in the draft"
            for i in differing[:_SHOWN_IDS]
        )
        more = "; ..." if len(differing) > _SHOWN_IDS else ""
        what = f"{len(differing)} token ids differ ({shown}{more})"
    else:
        what = f"one vocabulary adds {extra} tokens past the other's end (at most {MAX_VOCAB_PADDING})"
    raise TokenizerMismatchError(
        f"draft {config.draft!r} and target {config.target!r} use different tokenizers: {what}; "
        "speculative decoding needs the same vocabulary (use --proposer ngram, or a draft "
        "from the target's family)"
    )


def _tokens_by_id(vocab: dict[str, int]) -> dict[int, str]:
    return {i: token for token, i in vocab.items()}


def check_vocab_sizes(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Refuse embeddings whose sizes differ by more than padding (`MAX_VOCAB_PADDING` ids)."""
    target_vocab, draft_vocab = target.config.vocab_size, draft.config.vocab_size
    if abs(target_vocab - draft_vocab) > MAX_VOCAB_PADDING:
        raise TokenizerMismatchError(
            f"draft vocabulary of {draft_vocab} ids and target vocabulary of {target_vocab} ids "
            f"differ by more than padding (at most {MAX_VOCAB_PADDING} ids); speculative "
            "decoding needs the same tokenizer (use --proposer ngram, or a draft from the "
            "target's family)"
        )


def build_runners(
    config: EngineConfig, target: torch.nn.Module, draft: torch.nn.Module | None
) -> tuple[ModelRunner, ModelRunner | None]:
    """Size both paged caches so they hold the same number of tokens within the memory budget.

    The draft's runner puts out logits over the target's vocabulary (padded with -inf or cut, see
    `ModelRunner`), so draft and target probabilities line up id for id.
    """
    uses_draft = config.speculative and config.uses_draft_model
    if uses_draft and draft is None:
        raise ValueError("proposer 'draft' needs a draft model")
    if uses_draft:
        check_vocab_sizes(target, draft)
    models = [target] + ([draft] if uses_draft else [])
    kv_dtype = torch.float8_e4m3fn if config.kv_dtype == "fp8" else None
    # hybrid models: a recurrent-state slot per running sequence, as of its last k + 2 lengths
    states = {"state_slots": config.max_num_seqs, "state_depth": config.num_speculative_tokens + 2}
    num_blocks = config.num_blocks
    if num_blocks is None:  # the states come out of the memory budget first
        budget = int(config.kv_cache_memory_gib * GIB) - sum(ModelRunner.state_bytes(m, **states) for m in models)
        if budget <= 0:
            raise ValueError(
                f"the recurrent states of {config.max_num_seqs} sequences (max_num_seqs), each kept as of "
                f"{states['state_depth']} lengths (k + 2), take {-budget / GIB + config.kv_cache_memory_gib:.2f} GiB, "
                f"more than --kv-cache-memory {config.kv_cache_memory_gib:g} GiB: raise it, or lower "
                "--max-num-seqs or -k")
        per_block = [ModelRunner.kv_spec(m, config.block_size, kv_dtype).bytes_per_block() for m in models]
        num_blocks = max(1, budget // sum(per_block))
    output_vocab = target.config.vocab_size
    runners = [
        ModelRunner.build(m, config.block_size, kv_dtype, num_blocks=num_blocks, output_vocab=output_vocab,
                          attention_backend=config.attention_backend, static_steps=config.static_steps, **states)
        for m in models[1:]
    ]
    if (group := getattr(target, "rank_group", None)) is not None:
        if getattr(target.config, "linear", None) is not None:
            raise ValueError("a hybrid (linear-attention) target runs on one process: tensor and pipeline "
                             "parallelism do not split its recurrent states")
        from specdec.parallel.group import ParallelRunner

        cache = PagedKVCache(ModelRunner.kv_spec(target, config.block_size, kv_dtype), num_blocks)
        runners.insert(0, ParallelRunner(target, cache, output_vocab, config.attention_backend, group, config.kv_dtype))
    else:
        runners.insert(0, ModelRunner.build(target, config.block_size, kv_dtype, num_blocks=num_blocks,
                                            output_vocab=output_vocab, attention_backend=config.attention_backend,
                                            static_steps=config.static_steps, **states))
    return runners[0], (runners[1] if uses_draft else None)

