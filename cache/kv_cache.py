"""Paged KV tensors for one model, sized from a memory budget; fp8 (e4m3) storage with scales."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MIN_CAPABILITY = (8, 9)  # CUDA compute capability whose Triton converts e4m3 (Ada, Hopper)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and storage of one model's KV cache.

    ``dtype`` is the model dtype (fp32, bf16, fp16) or ``torch.float8_e4m3fn``, which halves the
    cache of a bf16 model; fp8 values are stored as ``value / scale``.

    A latent cache (``latent_rank`` > 0: multi-head latent attention) holds one plane instead of
    keys and values: per token one "head" of ``head_dim`` = latent rank + rope width values, whose
    first ``latent_rank`` are also the values (``PagedKVCache.layer`` gives them as a view).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    latent_rank: int = 0  # > 0: one plane of latents whose first latent_rank values are the values

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.latent_rank and not (0 < self.latent_rank <= self.head_dim and self.num_kv_heads == 1):
            raise ValueError(f"a latent cache has one head with its values in its first dims; got "
                             f"{self.num_kv_heads} heads of {self.head_dim} dims, latent rank {self.latent_rank}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"KV cache dtype must be a floating type, got {self.dtype}")
        if self.is_fp8 and torch.device(self.device).type == "cuda":
            capability = torch.cuda.get_device_capability(self.device)
            if capability < FP8_MIN_CAPABILITY:
                raise ValueError(
                    f"an fp8 KV cache needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                    f"{self.device} has {capability[0]}.{capability[1]}: use kv_dtype 'auto'"
                )

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def planes(self) -> int:
        """Tensors a layer keeps per token: keys and values (2), or the latent (1)."""
        return 1 if self.latent_rank else 2

    def bytes_per_token(self) -> int:
        """Bytes one token takes across all layers (keys and values, or the latent)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * elem

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return self.block_size * self.bytes_per_token()


class PagedKVCache:
    """The KV cache of one model: ``kv [L, 2, N, S, Hkv, D]`` (index 0 keys, 1 values), or for a
    latent spec ``kv [L, 1, N, S, 1, D]``.

    ``k_scale``/``v_scale`` convert between stored and real values (stored = value / scale,
    read = stored * scale); they matter for fp8 and are 1.0 otherwise by default.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, kv_scale: float = 1.0) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got num_blocks={num_blocks}")
        if not kv_scale > 0:
            raise ValueError(f"kv_scale must be > 0, got {kv_scale}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.k_scale = float(kv_scale)
        self.v_scale = float(kv_scale)
        shape = (spec.num_layers, spec.planes, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv = _zeros(shape, spec.dtype, spec.device)  # [L, 2, N, S, Hkv, D] (latent: [L, 1, N, S, 1, D])
        # each layer's (k, v) views, made once: every forward asks for every layer's; a latent
        # layer's values are its latents' first latent_rank dims
        self._layers = [
            (self.kv[i, 0], self.kv[i, 0][..., : spec.latent_rank] if spec.latent_rank else self.kv[i, 1])
            for i in range(spec.num_layers)
        ]

    @classmethod
    def from_memory_budget(
        cls, spec: KVCacheSpec, budget_bytes: int, kv_scale: float = 1.0
    ) -> PagedKVCache:
        """As many blocks as fit in ``budget_bytes``; ValueError if not even one does."""
        per_block = spec.bytes_per_block()
        num_blocks = int(budget_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {int(budget_bytes)} bytes is below one block "
                f"({per_block} bytes for {spec.num_layers} layers x {spec.planes} x {spec.block_size} tokens x "
                f"{spec.num_kv_heads} heads x {spec.head_dim} dims in {spec.dtype})"
            )
        return cls(spec, num_blocks, kv_scale=kv_scale)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k_cache, v_cache)``, each ``[N, S, Hkv, D]``, of layer ``i`` (latent: the
        latents ``[N, S, 1, D]`` and their first ``latent_rank`` dims)."""
        if not 0 <= i < self.spec.num_layers:
            raise ValueError(f"layer {i} out of range (0..{self.spec.num_layers - 1})")
        return self._layers[i]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Every layer's KV at slots ``src`` copied to slots ``dst`` (the sources read before any is
        written, so they may overlap): a token tree's accepted path moved to the slots of the
        positions it now holds (`keep_tree_path`)."""
        if len(src) != len(dst):
            raise ValueError(f"src and dst differ in length: {len(src)} and {len(dst)}")
        slots = self.num_blocks * self.block_size
        if any(not 0 <= x < slots for x in (*src, *dst)):
            raise ValueError(f"slots must be in 0..{slots - 1}")
        if not src:
            return
        flat = self.kv.view(self.spec.num_layers, self.spec.planes, slots, *self.kv.shape[4:])  # [L, P, N*S, H, D]
        index = lambda x: torch.tensor(x, dtype=torch.int64, device=self.kv.device)  # noqa: E731
        flat.index_copy_(2, index(dst), flat.index_select(2, index(src)))

    def make_resident(self) -> None:
        """Map every page of the cache now (zeros: call it before any block holds KV). The pages
        of a fresh cache are mapped on first write, a page fault each: bursts of blocks written at
        once (a handed-over prompt's, 63 MB) then take 4-15x their copy time (0.25 s here)."""
        self.kv.zero_()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on the CPU from `calloc` (numpy's zeros), whose fresh pages the kernel maps on first
    write, so a cache takes memory for the tokens it holds, not its whole budget (`torch.zeros`
    writes every byte: the whole budget was resident from the start)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
