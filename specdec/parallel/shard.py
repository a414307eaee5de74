"""Cut a loaded model to one rank's part, in place.

Tensor parallel (Megatron's split): q/k/v and gate|up keep this rank's output rows (its query
heads with their KV heads; its share of the MLP's width), o_proj and down_proj its input columns
inside a `RowParallelLinear`, whose output is the sum over the ranks. Every cut falls on whole
blocks of the weights' format (16 rows a tile; 32 or 256 inputs a block), so the bytes are the
loaded ones, moved. Pipeline parallel: a contiguous range of layers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

from specdec.target.config import ModelConfig
from specdec.target.layers import plus_linear
from specdec.target.model import LlamaForCausalLM
from specdec.target.model_weights import LoadPart
from specdec.target.moe import SparseMoE
from specdec.target.quant.qlinear import (
    QLinear, input_step, pack_tiles, release_freed_memory, take_inputs, take_output_tiles,
)


class ParallelConfigError(ValueError):
    """The model cannot be split this way (heads, widths or a layer type that does not divide)."""


class RowParallelLinear(nn.Module):
    """A linear over this rank's share of the inputs (`local`); its output is summed over the
    group (`group.all_reduce_`, fp32) before the residual add, which rounds as the unsplit
    linear's fused one does."""

    fuses_epilogue = True

    def __init__(self, local: nn.Module, group) -> None:
        super().__init__()
        self.local, self.group = local, group
        self.in_features, self.out_features = local.in_features, local.out_features

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
        if isinstance(self.local, QLinear):
            part = self.local(x, glu=glu, out_dtype=torch.float32)
        else:
            if glu:
                gate, up = x.chunk(2, dim=-1)
                x = F.silu(gate) * up
            part = self.local(x).float()
        part = self.group.all_reduce_(part.contiguous().view(-1)).view(part.shape).to(x.dtype)
        return part if residual is None else residual + part


def gather_columns(group, x: torch.Tensor, start: int, full: int, halves: int = 1) -> torch.Tensor:
    """Every rank's columns of `x [..., width]` gathered, in x's dtype: this rank's at `start`..
    (with `halves` 2, its first half at start.., its second at full + start..), summed over the
    group in fp32 with -0.0 in the columns others hold (x + -0.0 is x: exact, as decoder.c's)."""
    rows, width = x.shape[:-1], x.shape[-1]
    buf = torch.full((*rows, halves * full), -0.0, dtype=torch.float32)
    part = width // halves
    for h in range(halves):
        buf[..., h * full + start : h * full + start + part] = x[..., h * part : (h + 1) * part]
    return group.all_reduce_(buf.view(-1)).view(buf.shape).to(x.dtype)


class ColumnParallelLinear(nn.Module):
    """o_proj or down_proj split exactly: this rank's output rows over all inputs (`local`). The
    input's columns are gathered from every rank (this rank's at `inputs` = (start, full), of
    gate and of up each with `glu`), and the outputs into the whole hidden state: each value is
    computed by one rank as one process computes it."""

    fuses_epilogue = True

    def __init__(self, local: nn.Module, group, inputs: tuple[int, int], outputs: tuple[int, int, int]) -> None:
        super().__init__()
        self.local, self.group, self.inputs, self.outputs = local, group, inputs, outputs
        self.in_features, self.out_features = local.in_features, outputs[2]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
        start, width, full = self.outputs
        x = gather_columns(self.group, x, *self.inputs, halves=2 if glu else 1)
        res = None if residual is None else residual[..., start : start + width].contiguous()
        return gather_columns(self.group, plus_linear(res, self.local, x, glu), start, full)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's rows of the vocabulary (`local`, ids `start..end`); the
    logits come out whole on every rank: each rank's ids in place, zeros elsewhere, summed over
    the group (adding zeros is exact, so they are bitwise the unsplit head's)."""

    def __init__(self, local: nn.Module, start: int, vocab: int, group) -> None:
        super().__init__()
        self.local, self.start, self.group = local, start, group
        self.in_features, self.out_features = local.in_features, vocab
        self.fuses_rmsnorm = getattr(local, "fuses_rmsnorm", False)

    def forward(self, x: torch.Tensor, *norm) -> torch.Tensor:
        part = self.local(x, *norm)
        logits = torch.zeros(*part.shape[:-1], self.out_features, dtype=torch.float32)
        logits[..., self.start : self.start + part.shape[-1]] = part.float()
        return self.group.all_reduce_(logits.view(-1)).view(logits.shape)


def split(units: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s range of `units` split as evenly as whole units go (the first ranks one more)."""
    base, extra = divmod(units, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_tensor_parallel(cfg: ModelConfig, world: int) -> None:
    """`ParallelConfigError` where a model of config `cfg` does not split over `world` ranks."""
    why = None
    if cfg.moe is not None:
        why = "mixture-of-experts layers are not split yet (run them with --pipeline-parallel-size)"
    elif cfg.mla is not None:
        why = "latent attention (MLA) is not split yet"
    elif cfg.qk_norm_full:
        why = "q/k norms over all heads at once (OLMoE) need every head"
    elif cfg.num_heads % world:
        why = f"its {cfg.num_heads} query heads do not divide by {world}"
    elif cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        why = f"its {cfg.num_kv_heads} KV heads neither divide by {world} nor divide it"
    if why:
        raise ParallelConfigError(f"tensor parallelism over {world} ranks: {why}")


def load_part(mode: str, cfg: ModelConfig, rank: int, world: int, group, exact: bool = True) -> LoadPart:
    """What rank `rank` loads of a model of config `cfg` (`LoadPart`): a pipeline stage its
    layers only, a tensor-parallel rank every layer cut as it is read; never the whole model."""
    if mode == "pipeline":
        return LoadPart(layers=range(*split(cfg.num_layers, rank, world)))
    check_tensor_parallel(cfg, world)
    return LoadPart(cut=lambda i, layer: cut_layer(layer, cfg, rank, world, group, exact))


def tensor_parallel(model: LlamaForCausalLM, rank: int, world: int, group, exact: bool = True) -> None:
    """Keep rank `rank`'s part of every layer (those not cut while loading: `load_part`) and of
    the LM head's vocabulary (`VocabParallelHead`); `group` carries the all-reduces. `exact`:
    o_proj and down_proj by output rows with gathered inputs (`ColumnParallelLinear`: one
    process's bits), else by input columns with their partial sums added (`RowParallelLinear`:
    less on the wire)."""
    if any(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers):
        raise ParallelConfigError("tensor parallelism: mixture-of-experts layers are not split yet")
    cfg = model.config
    check_tensor_parallel(cfg, world)
    for layer in model.model.layers:
        cut_layer(layer, cfg, rank, world, group, exact)
    hq_local, kv_heads = _heads(cfg, rank, world)
    model.config = dataclasses.replace(cfg, num_heads=hq_local, num_kv_heads=len(kv_heads))
    vocab = model.lm_head.out_features
    a, b = (x * _row_unit(model.lm_head) for x in split(vocab // _row_unit(model.lm_head), rank, world))
    if rank == world - 1:
        b = vocab  # a vocabulary off the tile grid: its last rows on the last rank
    model.lm_head = VocabParallelHead(_rows(model.lm_head, [(a, b)]), a, vocab, group)
    _finish(model)


def _heads(cfg: ModelConfig, rank: int, world: int) -> tuple[int, list[int]]:
    """Rank `rank`'s number of query heads and its KV heads."""
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    hq_local = hq // world
    if hkv % world == 0:  # KV heads split with their query heads
        return hq_local, list(range(rank * hkv // world, (rank + 1) * hkv // world))
    return hq_local, [rank * hq_local // (hq // hkv)]  # fewer KV heads than ranks: the one its queries read


def cut_layer(layer: nn.Module, cfg: ModelConfig, rank: int, world: int, group, exact: bool = True) -> None:
    """Keep rank `rank`'s part of one decoder layer of a model of config `cfg` (the whole
    model's), in place; a layer already cut is left as it is."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(attn.o_proj, (RowParallelLinear, ColumnParallelLinear)):
        return
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hq_local, kv_heads = _heads(cfg, rank, world)
    q = (rank * hq_local * d, (rank + 1) * hq_local * d)
    qkv_rows = [q] + [(hq * d + j * d, hq * d + (j + 1) * d) for j in kv_heads]
    qkv_rows += [((hq + hkv) * d + j * d, (hq + hkv) * d + (j + 1) * d) for j in kv_heads]
    if attn.qkv_proj is not None:
        attn.qkv_proj = _rows(attn.qkv_proj, qkv_rows)
    else:
        attn.q_proj = _rows(attn.q_proj, [q])
        attn.k_proj = _rows(attn.k_proj, [(j * d, (j + 1) * d) for j in kv_heads])
        attn.v_proj = _rows(attn.v_proj, [(j * d, (j + 1) * d) for j in kv_heads])
    attn.num_heads, attn.num_kv_heads = hq_local, len(kv_heads)
    width = mlp.down_proj.in_features
    gate = mlp.gate_up_proj if mlp.gate_up_proj is not None else mlp.gate_proj
    unit = _row_unit(gate) if exact else math.lcm(_input_unit(mlp.down_proj), _row_unit(gate))
    if width % unit:
        raise ParallelConfigError(f"the MLP's width {width} is not made of blocks of {unit}")
    a, b = (unit * x for x in split(width // unit, rank, world))
    if mlp.gate_up_proj is not None:
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, [(a, b), (width + a, width + b)])
    else:
        mlp.gate_proj, mlp.up_proj = _rows(mlp.gate_proj, [(a, b)]), _rows(mlp.up_proj, [(a, b)])
    if not exact:
        attn.o_proj = RowParallelLinear(_inputs(attn.o_proj, *q, bias=rank == 0), group)
        mlp.down_proj = RowParallelLinear(_inputs(mlp.down_proj, a, b, bias=rank == 0), group)
        return
    hidden = cfg.hidden_size
    unit = math.lcm(_row_unit(attn.o_proj), _row_unit(mlp.down_proj))
    c, e = (unit * x for x in split(hidden // unit, rank, world))
    attn.o_proj = ColumnParallelLinear(_rows(attn.o_proj, [(c, e)]), group, (q[0], hq * d), (c, e - c, hidden))
    mlp.down_proj = ColumnParallelLinear(_rows(mlp.down_proj, [(c, e)]), group, (a, width), (c, e - c, hidden))
    if group is not None and hasattr(group, "set_columns"):  # the C layer loop's layout of this rank
        group.set_columns(att=(q[0], q[1] - q[0], hq * d), ffn=(a, b - a, width), out=(c, e - c, hidden))


def pipeline_stage(model: LlamaForCausalLM, stage: int, stages: int) -> tuple[int, int]:
    """Keep stage `stage`'s layers (as even a split as whole layers go); the embedding stays on
    the first stage, the final norm and LM head on the first too (the driver: the last stage
    sends its hidden rows back). Returns the stage's layer range."""
    layers, total = model.model.layers, model.config.num_layers
    if total < stages:
        raise ParallelConfigError(f"{total} layers cannot fill {stages} pipeline stages")
    a, b = split(total, stage, stages)
    if (model.layer_offset, len(layers)) != (a, b - a):  # not loaded as the stage's part already
        model.model.layers = nn.ModuleList(list(layers)[a:b])
        model.layer_offset = a
    if stage != 0:
        model.lm_head = None
        model.model.embed_tokens = None
    _finish(model)
    return a, b


def _finish(model: LlamaForCausalLM) -> None:
    """The kept tiles end to end in one arena (what the loader does), the rest freed."""
    pack_tiles([m for m in model.modules() if isinstance(m, QLinear)])
    release_freed_memory()


def _rows(linear: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    if isinstance(linear, QLinear):
        return take_output_tiles(linear, ranges)
    rows = torch.cat([torch.arange(a, b) for a, b in ranges])
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    return out


def _inputs(linear: nn.Module, start: int, end: int, bias: bool) -> nn.Module:
    if isinstance(linear, QLinear):
        step = input_step(linear)
        if start % step or end % step:
            raise ParallelConfigError(f"a rank's inputs [{start}, {end}) of a linear cut its blocks of {step} "
                                      "inputs: this tensor-parallel size does not fit the weights' format")
        return take_inputs(linear, start, end, bias)
    out = nn.Linear(end - start, linear.out_features, bias=bias and linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight[:, start:end].clone(), requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(linear.bias.clone(), requires_grad=False)
    return out


def _input_unit(linear: nn.Module) -> int:
    return input_step(linear) if isinstance(linear, QLinear) else 1


def _row_unit(linear: nn.Module) -> int:
    return 16 if isinstance(linear, QLinear) else 1
