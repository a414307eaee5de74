"""A mixture-of-experts block in one C call (`moe.c`'s `moe_block`) once its experts are `QLinear`s.

`NativeMoE.build(block, lib)` snapshots the router and every expert's tiles into a `kernel_abi.Moe`
table (`decoder_stack.attach_moe`, which the runner calls after the last change to the weights,
with the decoder library `moe_block` is built into; `NativeDecoderStack` puts the same table into
its layer rows); `run` is the block's forward: RMSNorm, router, top k,
each chosen expert's gate|up and down over just its rows (each expert's tiles read once per call),
the shared expert, the residual add. A block whose experts or router do not fit keeps its torch
forward (`moe.SparseMoE`), which is correct for every shape.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from specdec import kernel_abi
from specdec.kernel_abi import check_tensor
from specdec.target.quant import qgemm
from specdec.target.quant.qlinear import QLinear

DENSE = (torch.bfloat16, torch.float32)  # what the router and the activations may be


def linear_descriptor(linear: QLinear, refs: list) -> kernel_abi.Linear:
    """`linear`'s buffers as a `kernel_abi.Linear`, checked first (`qgemm.check_weights`); the
    buffers are appended to `refs`, which the caller keeps alive as long as the descriptor."""
    qgemm.check_weights(linear.tiles, linear.tile_offsets, linear.tile_bits, linear.bias, linear.in_features,
                        linear.out_features)
    refs += [t for t in (linear.tiles, linear.tile_offsets, linear.tile_bits, linear.bias) if t is not None]
    return kernel_abi.Linear(
        linear.tiles.data_ptr(), linear.tile_offsets.data_ptr(), linear.tile_bits.data_ptr(),
        linear.in_features, linear.out_features, None if linear.bias is None else linear.bias.data_ptr(),
    )


class NativeMoE:
    """The `kernel_abi.Moe` table of one `SparseMoE` block; holds every buffer it points to."""

    def __init__(self, block: nn.Module, lib: ctypes.CDLL) -> None:
        self.lib = lib
        experts = block.experts
        self._refs: list = []
        self.gate_up = (kernel_abi.Linear * len(experts))(*(self._linear(e.gate_up_proj) for e in experts))
        self.down = (kernel_abi.Linear * len(experts))(*(self._linear(e.down_proj) for e in experts))
        router = block.gate.weight
        self.hidden = router.shape[1]
        check_tensor("router", router, DENSE, tuple(router.shape))
        self._refs.append(router)
        self.table = kernel_abi.Moe(
            router=router.data_ptr(), gate_up=self.gate_up, down=self.down, num_experts=len(experts),
            top_k=block.top_k, hidden=self.hidden, router_bf16=router.dtype == torch.bfloat16,
            norm_topk=block.norm_topk,
        )
        if block.shared_expert is not None:
            self.shared = (self._linear(block.shared_expert.gate_up_proj), self._linear(block.shared_expert.down_proj))
            self.table.shared_gate_up, self.table.shared_down = (ctypes.pointer(s) for s in self.shared)
            if block.shared_expert_gate is not None:  # Qwen2-MoE; DeepSeek's shared experts are ungated
                gate = block.shared_expert_gate.weight
                check_tensor("shared_expert_gate", gate, (router.dtype,), (1, self.hidden))
                self._refs.append(gate)
                self.table.shared_gate = gate.data_ptr()

    def _linear(self, linear: QLinear) -> kernel_abi.Linear:
        return linear_descriptor(linear, self._refs)

    @staticmethod
    def fits(block: nn.Module) -> bool:
        """Every expert (and the shared one) a fused gate|up `QLinear` and a down `QLinear`, the
        router dense in bf16 or fp32 routing as the kernel does (`MoEConfig.plain_routing`), and
        the hidden size a multiple of 32; experts without biases or gpt-oss's clamp (`plain_experts`)."""
        mlps = [*block.experts, *([block.shared_expert] if block.shared_expert is not None else [])]
        return (
            block.routing.plain_routing and block.routing.plain_experts
            and all(isinstance(getattr(m, "gate_up_proj", None), QLinear) and isinstance(m.down_proj, QLinear) for m in mlps)
            and type(block.gate) is not QLinear
            and block.gate.weight.dtype in DENSE
            and block.gate.weight.shape[1] % kernel_abi.GROUP == 0
        )

    @classmethod
    def build(cls, block: nn.Module, lib: ctypes.CDLL | None) -> "NativeMoE | None":
        """The table of `block` where it `fits` and the library (`decoder_stack.kernel`, which
        `moe_block` is built into) loaded, else None."""
        return cls(block, lib) if lib is not None and cls.fits(block) else None

    def run(self, block: nn.Module, x: torch.Tensor, norm: nn.Module | None,
            residual: torch.Tensor | None) -> torch.Tensor | None:
        """`residual + block(norm(x))` in one call, `block.last_expert_ids` set; None where this
        call does not fit (x not a CPU float tensor, a norm other than RMSNorm)."""
        norm_w = None if norm is None else norm.weight
        if not (x.device.type == "cpu" and x.dtype in DENSE and x.dim() == 2 and x.shape[1] == self.hidden
                and (norm is None or (getattr(norm, "kernel_fusable", False) and norm_w.dtype in DENSE))):
            return None
        x = x.contiguous()
        if residual is not None:
            residual = residual.contiguous()
            check_tensor("residual", residual, (x.dtype,), tuple(x.shape))
        y = torch.empty_like(x)
        ids = torch.empty(x.shape[0], self.table.top_k, dtype=torch.int32)
        rc = self.lib.moe_block(
            x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0], ctypes.byref(self.table),
            None if norm_w is None else norm_w.data_ptr(), norm_w is not None and norm_w.dtype == torch.bfloat16,
            0.0 if norm is None else norm.eps, None if residual is None else residual.data_ptr(), y.data_ptr(),
            ids.data_ptr(), torch.get_num_threads(),
        )
        kernel_abi.raise_for_status(rc, "moe_block")
        block.last_expert_ids = ids
        return y
