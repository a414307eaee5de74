"""Model runner: one model, its paged KV cache, and the varlen batch of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.cache import (
    AttentionMetadata, BlockPool, BlockTable, KVCacheSpec, PagedKVCache, RecurrentStateCache, StateSpec,
    build_attention_metadata,
)
from specdec.cache.attention import check_backend
from specdec.cache.metadata import with_tree
from specdec.target.model import LlamaForCausalLM
from specdec.target.moe import SparseMoE
from specdec.target.quant.decoder_stack import NativeDecoderStack, attach_moe
from specdec.target.static_step import StaticSteps

STATIC_STEPS = ("off", "eager", "graphs")


@dataclass
class Window:
    """One sequence's slice of a forward: `token_ids` are fed from position `table.num_computed`.

    The runner keeps logits for the last `num_logits` rows of the window (1 for prefill or plain
    decoding, k+1 for verification, 0 for a pure cache fill).

    >>> Window(table, [7, 5, 3, 9], 4, parents=[-1, 0, 0, 1])   # doctest: +SKIP  (5 and 3 after 7, 9 after 5)
    """

    table: BlockTable
    token_ids: list[int] | torch.Tensor  # a device tensor avoids a host sync in the draft loop
    num_logits: int = 1
    # a token tree's window: each row's parent row (-1: under the cached prefix alone), each row at
    # position start + its depth and attending to its ancestors only (`cache.metadata.with_tree`)
    parents: list[int] | None = None


@dataclass
class Step:
    """One forward's tensors: flat `input_ids [T]`, `positions [T]`, the attention metadata, the
    rows to keep logits for `[R]`, and where each window ends."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    ends: list[int]


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of `module`'s parameters and buffers, each storage once (meta tensors: none)."""
    tensors = {t.data_ptr(): t for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class ModelRunner:
    """Owns a model, its `PagedKVCache` and the `BlockPool` over that cache's blocks.

    `output_vocab` fits a draft to its target's vocabulary when the two differ only by padding
    (Qwen2.5-7B and up pad to 152,064 ids, the 0.5B to 151,936; same tokenizer): logits come out
    `[R, output_vocab]`, the ids the model lacks at -inf (probability 0, so rejection sampling
    stays exact: the residual max(0, p - q) covers the target's mass there), the ids past
    `output_vocab` cut off (the draft samples from what is left); fed ids the model lacks (the
    target may emit a padding id) read as id 0, which can only cost acceptance.

        >>> runner = ModelRunner.build(draft, 16, num_blocks=64, output_vocab=152064)  # doctest: +SKIP
        >>> runner.forward(windows).shape                                            # doctest: +SKIP
        torch.Size([R, 152064])
    """

    def __init__(
        self, model: LlamaForCausalLM, kv_cache: PagedKVCache, output_vocab: int | None = None,
        attention_backend: str = "auto", static_steps: str = "off", state_slots: int = 16, state_depth: int = 8,
    ) -> None:
        check_backend(attention_backend, model.model.norm.weight.device)
        self.attention_backend = attention_backend  # every forward's `meta.backend`
        self.model = model
        self.kv_cache = kv_cache
        self.model_vocab = model.config.vocab_size
        self.output_vocab = output_vocab or self.model_vocab
        self.block_size = kv_cache.spec.block_size
        # `static_steps` "eager" / "graphs": decode and verify steps padded to token buckets
        # (`static_step`; "graphs" captures them on CUDA), the cache's last block the padded
        # rows' and outside the pool; "off": every step its own shape
        if static_steps not in STATIC_STEPS:
            raise ValueError(f"static_steps must be one of {STATIC_STEPS}, got {static_steps!r}")
        bucketed = (static_steps != "off" and model.config.mla is None and model.config.linear is None
                    and kv_cache.num_blocks > 1)
        self.pool = BlockPool(kv_cache.num_blocks - bucketed)
        # a hybrid model's linear-attention states: a slot per running sequence, each keeping the
        # states after its last `state_depth` positions (a verify window's rows, a draft's steps)
        self.states = self._state_cache(model, state_slots, state_depth)
        self.pool.states = self.states
        self.device = model.model.norm.weight.device
        self.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        # The weights are final here: run MoE blocks and the layers from C where they fit, else
        # the Python loop (and the blocks' torch forward).
        attach_moe(model)
        model.use_layer_stack(NativeDecoderStack.build(model))
        self.static_steps = StaticSteps(self, kv_cache.num_blocks - 1, static_steps == "graphs") if bucketed else None

    @staticmethod
    def _state_spec(model: LlamaForCausalLM) -> StateSpec | None:
        lin = model.config.linear
        if lin is None:
            return None
        return StateSpec(len(lin.layers), lin.conv_dim, lin.conv_kernel - 1, lin.num_value_heads,
                         lin.key_head_dim, lin.value_head_dim, torch.float32, model.model.norm.weight.device)

    @classmethod
    def _state_cache(cls, model: LlamaForCausalLM, slots: int, depth: int) -> RecurrentStateCache | None:
        spec = cls._state_spec(model)
        return None if spec is None else RecurrentStateCache(spec, slots, depth)

    @classmethod
    def state_bytes(cls, model: LlamaForCausalLM, state_slots: int, state_depth: int) -> int:
        """The bytes of a hybrid model's recurrent states for `state_slots` sequences (0: none)."""
        spec = cls._state_spec(model)
        return 0 if spec is None else spec.slot_bytes * state_slots * state_depth

    @staticmethod
    def kv_spec(
        model: LlamaForCausalLM, block_size: int, kv_dtype: torch.dtype | None = None
    ) -> KVCacheSpec:
        """The model's KV cache layout; `kv_dtype` None means the model's own dtype."""
        cfg = model.config
        param = model.model.norm.weight  # dense in every model, in the model's dtype (the embedding
        # may have no parameter: `GGUFEmbedding`)
        mla = cfg.mla  # multi-head latent attention caches one latent per token and layer
        return KVCacheSpec(
            # a pipeline stage's own; a hybrid's attention layers only (its linear layers keep states)
            num_layers=sum(layer.self_attn is not None for layer in model.model.layers),
            num_kv_heads=1 if mla else cfg.num_kv_heads,
            head_dim=mla.latent_dim if mla else cfg.head_dim,
            block_size=block_size,
            dtype=kv_dtype or param.dtype,
            device=param.device,
            latent_rank=mla.kv_lora_rank if mla else 0,
        )

    @classmethod
    def build(
        cls,
        model: LlamaForCausalLM,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
        *,
        num_blocks: int,
        output_vocab: int | None = None,
        attention_backend: str = "auto",
        static_steps: str = "off",
        state_slots: int = 16,
        state_depth: int = 8,
    ) -> "ModelRunner":
        """A runner whose paged cache has `num_blocks` blocks of `block_size` tokens (one more,
        outside the pool, with `static_steps`); logits `[R, output_vocab]` (None: the model's own
        vocabulary). A hybrid model's recurrent states: `state_slots` sequences, each as of its
        last `state_depth` lengths (`cache.state_cache`)."""
        extra = static_steps != "off" and model.config.mla is None and model.config.linear is None
        kv_cache = PagedKVCache(cls.kv_spec(model, block_size, kv_dtype), num_blocks + extra)
        return cls(model, kv_cache, output_vocab, attention_backend, static_steps, state_slots, state_depth)

    def memory_bytes(self) -> tuple[int, int]:
        """(weights, KV pool): the bytes of the model's parameters and buffers (an embedding left
        in its GGUF file is read from the file and not counted) and of its cache's whole budget,
        whose pages a CPU cache takes only as tokens are written (`kv_cache._zeros`), with a hybrid's
        recurrent states."""
        states = 0 if self.states is None else self.states.memory_bytes  # a hybrid's recurrent states
        return weight_bytes(self.model), self.kv_cache.kv.numel() * self.kv_cache.kv.element_size() + states

    @property
    def routing(self) -> tuple[int, int] | None:
        """(experts, top k) of an MoE model; None for a dense one."""
        moe = self.model.config.moe
        return None if moe is None else (moe.num_experts, moe.top_k)

    def expert_ids(self) -> torch.Tensor | None:
        """`[L, T, k]`: the experts each row of the latest forward chose in each MoE layer; None
        for a dense model."""
        if not self.moe_blocks:
            return None
        return torch.stack([b.last_expert_ids for b in self.moe_blocks]).cpu()

    def new_table(self) -> BlockTable:
        return BlockTable(self.pool, self.block_size)

    @property
    def max_positions(self) -> int:
        return self.model.max_positions

    def forward(self, windows: list[Window]) -> torch.Tensor:
        """Run all windows in one pass; returns logits `[sum(num_logits), V]` in window order.

        Each table must already have slots for its window (`ensure_slots`); its `num_computed`
        advances past the window.
        """
        trees = any(w.parents is not None for w in windows)
        if not trees and self.static_steps is not None and (logits := self.static_steps.run(windows)) is not None:
            return self._fit_vocab(logits)  # the tables advanced as they were filled in
        step = self.prepare(windows)
        logits = self.run_step(step)
        if step.meta.states is not None:
            step.meta.states.commit()
        for w, end in zip(windows, step.ends):
            w.table.num_computed = end
        return self._fit_vocab(logits)

    def run_step(self, step: "Step") -> torch.Tensor:
        """The model over one prepared step: logits `[R, model vocab]`."""
        return self.model(step.input_ids, step.positions, self.kv_cache, step.meta, step.logits_indices)

    def prepare(self, windows: list[Window]) -> "Step":
        """The tensors of one forward over `windows` (nothing run, no table advanced)."""
        starts = [w.table.num_computed for w in windows]
        ends = [s + len(w.token_ids) for s, w in zip(starts, windows)]
        for w, start, end in zip(windows, starts, ends):
            assert end <= w.table.capacity, "window exceeds the table's allocated slots"
            assert start >= w.table.num_frozen_tokens, "a window would write into a cached block"
        positions, logits_indices = [], []
        offset = 0
        for w, start, end in zip(windows, starts, ends):
            positions.extend(range(start, end) if w.parents is None else (start + d for d in _depths(w.parents)))
            offset += end - start
            logits_indices.extend(range(offset - w.num_logits, offset))
        meta = build_attention_metadata([w.table for w in windows], starts, ends, self.device)
        if any(w.parents is not None for w in windows):
            if self.states is not None:
                raise ValueError("token trees over linear attention are not supported: a recurrent state "
                                 "follows one path")
            meta = with_tree(meta, [w.parents for w in windows])
        if self.states is not None:
            for w in windows:
                if w.table.state_slot is None:
                    w.table.state_slot = self.states.pool.allocate()
            meta.states = self.states.batch([w.table.state_slot for w in windows], starts, ends)
        meta.backend = self.attention_backend
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return Step(self._input_ids(windows), as_tensor(positions), meta, as_tensor(logits_indices), ends)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [R, model_vocab] -> [R, output_vocab]
        extra = self.output_vocab - self.model_vocab
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[:, : self.output_vocab] if extra < 0 else logits

    def _input_ids(self, windows: list[Window]) -> torch.Tensor:
        """Flat `[T]` token ids; host lists become one tensor, device tensors are concatenated."""
        if all(isinstance(w.token_ids, list) for w in windows):
            flat = [t for w in windows for t in w.token_ids]
            ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        else:
            ids = torch.cat([
                w.token_ids.reshape(-1) if isinstance(w.token_ids, torch.Tensor)
                else torch.tensor(w.token_ids, dtype=torch.long, device=self.device)
                for w in windows
            ])
        if self.output_vocab > self.model_vocab:  # padding ids the model has no embedding for
            ids = torch.where(ids < self.model_vocab, ids, torch.zeros_like(ids))
        return ids


def _depths(parents: list[int]) -> list[int]:
    """Each tree row's depth (a root under the cached prefix: 0), so its position is start + depth."""
    depths: list[int] = []
    for row, parent in enumerate(parents):
        if not -1 <= parent < row:
            raise ValueError(f"tree row {row}'s parent must be an earlier row or -1, got {parent}")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths
