"""The sparse MLP of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
DeepSeek-V2/V3).

A router (`gate`, kept dense) scores every expert per token; the top k experts, each a SiLU-GLU
MLP (`experts[e]`, the dense `MLP` with the expert's width), run on just the rows that chose them,
and their outputs are summed with the router weights. gpt-oss's router and experts have biases,
and its experts clamp their SwiGLU (`MoEConfig.swiglu_limit`; checkpoints interleave gate and up). Qwen2-MoE adds a shared expert on every
row, scaled by `sigmoid(shared_expert_gate(x))`; DeepSeek's shared experts (one MLP as wide as
all of them, `shared_experts` in its checkpoints) are added unscaled. DeepSeek's routing variants
(groups, sigmoid scores with a choosing bias, a scale) are `MoEConfig`'s fields.

Parameter names are transformers' checkpoint names (`mlp.gate`, `mlp.experts.{e}.gate_proj`, ...);
transformers' own modules stack the experts (`experts.gate_up_proj [E, 2I, H]`), which
`split_stacked_experts` turns into ours.

The torch forward here is the reference (and the path where the experts do not fit the C kernel);
a runner gives the block an `ExpertKernel` (`quant.moe_kernel`: the whole block, router to residual,
in one C call) once its experts are quantized. Either way the block keeps the last forward's
choices in `last_expert_ids [T, k]`, which the engine turns into experts read per window.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specdec.target.config import ModelConfig


class ExpertKernel(Protocol):
    """Another way to run a whole `SparseMoE` (`quant.moe_kernel.NativeMoE`); the runner sets it."""

    def run(self, block: "SparseMoE", x: torch.Tensor, norm: nn.Module | None,
            residual: torch.Tensor | None) -> torch.Tensor | None:
        """`residual + block(norm(x))` with `block.last_expert_ids` set; None where it cannot."""


class Router(nn.Linear):
    """The expert scores `[T, E]`; a plain linear the quantizers leave dense (`keep_dense`): its
    argmaxes choose the experts, and llama.cpp keeps it in float too. DeepSeek-V3's router holds
    the per-expert bias that chooses (`e_score_correction_bias`, fp32) beside its weight."""

    keep_dense = True

    def __init__(self, hidden: int, num_experts: int, score_bias: bool = False, bias: bool = False) -> None:
        super().__init__(hidden, num_experts, bias=bias)  # bias: gpt-oss's, added to the logits
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if score_bias else None

    def _apply(self, fn, *args, **kwargs):  # the bias stays fp32, unrounded (it decides near-ties)
        bias = self.e_score_correction_bias
        out = super()._apply(fn, *args, **kwargs)
        if bias is not None and self.e_score_correction_bias.dtype != torch.float32:
            moved = bias.detach().to(device=self.e_score_correction_bias.device, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(moved, requires_grad=False)
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, mlp_class: type[nn.Module]) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.num_experts, self.top_k, self.norm_topk = moe.num_experts, moe.top_k, moe.norm_topk
        self.routing = moe
        self.gate = Router(config.hidden_size, moe.num_experts, moe.score_bias, moe.router_bias)
        self.experts = nn.ModuleList(mlp_class(config, moe.expert_size, expert=True) for _ in range(moe.num_experts))
        self.shared_expert = mlp_class(config, moe.shared_expert_size) if moe.shared_expert_size else None
        gated = moe.shared_expert_size and moe.shared_expert_gated
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if gated else None
        self.kernel: ExpertKernel | None = None  # see ExpertKernel
        self.last_expert_ids: torch.Tensor | None = None  # [T, k] of the last forward

    def _apply(self, fn, *args, **kwargs):
        self.kernel = None  # .to() and friends: the kernel's table points at the old buffers
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        return {**super().__getstate__(), "kernel": None}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weights [T, k] in x's dtype, expert ids [T, k])`: softmax over every expert in fp32,
        the top k, renormalized where the family does (transformers' routers); DeepSeek's
        variants as `MoEConfig` describes them."""
        moe = self.routing
        if moe.fp32_router:
            logits = F.linear(x.float(), self.gate.weight.float(), None if self.gate.bias is None else self.gate.bias.float())
        else:
            logits = self.gate(x)
        scores = logits.float().sigmoid() if moe.scoring == "sigmoid" else F.softmax(logits, dim=-1, dtype=torch.float32)
        if moe.num_groups == 1 and not moe.score_bias:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        else:
            choice = scores if self.gate.e_score_correction_bias is None else scores + self.gate.e_score_correction_bias
            if moe.num_groups > 1:  # only the experts of the best `topk_groups` groups may be chosen
                groups = choice.view(x.shape[0], moe.num_groups, -1)  # [T, G, E / G]
                group_scores = groups.amax(-1) if moe.group_score == "max" else groups.topk(2, dim=-1).values.sum(-1)
                kept = torch.zeros_like(group_scores, dtype=torch.bool)
                kept.scatter_(1, torch.topk(group_scores, moe.topk_groups, dim=-1).indices, True)
                choice = choice.masked_fill(~kept.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if moe.routed_scaling != 1.0:
            weights = weights * moe.routed_scaling
        return weights.to(x.dtype), ids

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        norm: nn.Module | None = None,  # applied to x first
        residual: torch.Tensor | None = None,  # [T, hidden]: returned plus the block's output
    ) -> torch.Tensor:  # [T, hidden]
        if self.kernel is not None and (out := self.kernel.run(self, x, norm, residual)) is not None:
            return out
        x = x if norm is None else norm(x)
        weights, ids = self.route(x)
        self.last_expert_ids = ids
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            rows, slots = torch.where(ids == e)
            y = self.experts[e](x[rows]) * weights[rows, slots, None]
            out.index_add_(0, rows, y.to(out.dtype))
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out if residual is None else residual + out


_STACKED = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?P<bias>_bias)?$")
_ROUTER = re.compile(r"(?P<layer>.*\.mlp)\.router\.(?P<kind>weight|bias)$")


def split_stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with transformers' stacked experts (`mlp.experts.gate_up_proj [E, 2I, H]`,
    `mlp.experts.down_proj [E, H, I]`) split into per-expert linears, as checkpoints store them.
    gpt-oss's (told by their biases) are stored transposed (`[E, H, 2I]`, `[E, I, H]`) with gate
    and up interleaved, and its router is `mlp.router` (ours: `mlp.gate`).

        >>> split_stacked_experts({"m.mlp.experts.down_proj": torch.zeros(2, 4, 3)}).keys()
        dict_keys(['m.mlp.experts.0.down_proj.weight', 'm.mlp.experts.1.down_proj.weight'])
    """
    out = {}
    for name, tensor in state.items():
        if r := _ROUTER.fullmatch(name):
            out[f"{r['layer']}.gate.{r['kind']}"] = tensor
            continue
        m = _STACKED.fullmatch(name)
        if m is None:
            out[name] = tensor
            continue
        transposed = f"{m['prefix']}.gate_up_proj_bias" in state  # gpt-oss
        kind = "bias" if m["bias"] else "weight"
        for e, w in enumerate(tensor):
            if transposed and not m["bias"]:
                w = w.T
            if m["kind"] == "down_proj":
                out[f"{m['prefix']}.{e}.down_proj.{kind}"] = w
                continue
            gate, up = (w[0::2], w[1::2]) if transposed else w.chunk(2, dim=0)
            out[f"{m['prefix']}.{e}.gate_proj.{kind}"] = gate.contiguous()
            out[f"{m['prefix']}.{e}.up_proj.{kind}"] = up.contiguous()
    return out
