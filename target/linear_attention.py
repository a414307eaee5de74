"""Gated DeltaNet, the linear attention of hybrid models (Qwen3-Next, Qwen3.5), beside GQA and MLA as a
layer's token mixer (chosen by `ModelConfig.linear`).

Per token t and value head h, after a causal depthwise convolution (kernel K, SiLU) over the
projected q | k | v:

    S_t = exp(g_t) * S_{t-1}                          decay, g = -exp(A_log) * softplus(a + dt_bias)
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T       the delta rule, beta = sigmoid(b)
    o_t = S_t^T q_t / sqrt(Dk)                         q, k L2-normalised

then a gated RMSNorm (norm(o) * silu(z)) and `out_proj`. The state S `[H, Dk, Dv]` and the
convolution's last K-1 inputs are the whole memory of the sequence: they live in the runner's
`cache.RecurrentStateCache`, read as of each window's start and written after each of its last
rows (`meta.states`), so that a verify window's rejected rows are dropped by starting the next
forward from the state of the last kept one. Parameter names are transformers'
(`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`), so its state dicts load as they are; the arithmetic follows its
recurrent form token by token in fp32 (the chunked form of its prefill is the same sums in
another order). On the CPU one C call per window does the convolution, the norms and the
recurrence (`linear_attention.c`, writing the kept states into the ring in place); the torch
steps below run where no kernel does.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec import kernel_abi, native
from specdec.cache import AttentionMetadata
from specdec.target.config import ModelConfig
from specdec.target.layers import RMSNorm, plus_linear


class DenseLinear(nn.Linear):
    """A linear the quantizers leave dense (`keep_dense`)."""

    keep_dense = True


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output in fp32, scaled by `weight` in the model dtype, times
    silu(gate) (transformers' `Qwen3NextRMSNormGated`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One window's recurrence, token by token in fp32: `q, k [n, H, Dk]` (already per value
    head), `v [n, H, Dv]`, `g, beta [n, H]`, `state [H, Dk, Dv]` as of the window's start.
    Returns the outputs `[n, H, Dv]` and the states after each of the last `keep` rows
    `[keep, H, Dk, Dv]`."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v = l2norm(k.float()), v.float()
    decay, beta = g.float().exp(), beta.float()
    n = q.shape[0]
    out = torch.empty_like(v)
    kept = []
    s = state.float()
    for t in range(n):
        s = s * decay[t, :, None, None]
        delta = (v[t] - (s * k[t, :, :, None]).sum(-2)) * beta[t, :, None]  # [H, Dv]
        s = s + k[t, :, :, None] * delta[:, None, :]
        out[t] = (s * q[t, :, :, None]).sum(-2)
        if t >= n - keep:
            kept.append(s)
    return out, torch.stack(kept) if kept else s.new_empty(0, *s.shape)


SOURCE = Path(__file__).with_name("linear_attention.c")


def kernel(level: native.SimdLevel | str | None = None) -> native.NativeKernel:
    """The recurrence's library for `level` (None: the one this machine runs)."""
    return native.simd_kernel((SOURCE,), ("gated_delta_window",), level)


@functools.cache
def _lib(level: str | None = None) -> ctypes.CDLL | None:
    return kernel(level).load()


def load_kernel(level: str | None = None) -> ctypes.CDLL | None:
    """The loaded library, or None where it cannot run (`SPECDEC_NO_KERNELS=1`, no compiler,
    `SPECDEC_ISA`): then the torch recurrence below runs."""
    return None if kernel(level).unavailable_reason() is not None else _lib(level)


def gated_delta_window_c(
    lib: ctypes.CDLL, mixed: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    key_heads: int, dk: int, dv: int, tiled: bool, start: tuple[torch.Tensor, torch.Tensor] | None,
    conv_out: list[torch.Tensor], ssm_out: list[torch.Tensor],
) -> torch.Tensor:
    """One window in C (`linear_attention.c`): `mixed [n, C]` (q | k | v before the convolution),
    `conv_weight [C, K]`, `g, beta [n, H]`, all fp32; `start` the states as of the window's start
    (None: zeros); the states after each of its last `len(conv_out)` rows written into
    `conv_out [C, K-1]` / `ssm_out [H, Dk, Dv]`. Returns the outputs `[n, H, Dv]` fp32."""
    n, channels = mixed.shape
    heads, kernel_size = g.shape[1], conv_weight.shape[1]
    f32 = (torch.float32,)
    kernel_abi.check_tensor("mixed", mixed, f32, (n, channels))
    kernel_abi.check_tensor("conv_weight", conv_weight, f32, (channels, kernel_size))
    kernel_abi.check_tensor("g", g, f32, (n, heads))
    kernel_abi.check_tensor("beta", beta, f32, (n, heads))
    shapes = {"conv": (channels, kernel_size - 1), "ssm": (heads, dk, dv)}
    for name, t in (("conv", start[0]), ("ssm", start[1])) if start is not None else ():
        kernel_abi.check_tensor(f"{name} state", t, f32, shapes[name])
    for name, ts in (("conv", conv_out), ("ssm", ssm_out)):
        for t in ts:
            kernel_abi.check_tensor(f"{name} state", t, f32, shapes[name])
    if len(conv_out) != len(ssm_out) or len(conv_out) > n:
        raise ValueError(f"{len(conv_out)} conv and {len(ssm_out)} ssm states to write after a window of {n} rows")
    out = torch.empty(n, heads, dv, dtype=torch.float32)
    keep = len(conv_out)
    conv_ptrs = (ctypes.c_void_p * max(keep, 1))(*[t.data_ptr() for t in conv_out])
    ssm_ptrs = (ctypes.c_void_p * max(keep, 1))(*[t.data_ptr() for t in ssm_out])
    rc = lib.gated_delta_window(
        mixed.data_ptr(), n, conv_weight.data_ptr(), channels, kernel_size, g.data_ptr(), beta.data_ptr(), key_heads,
        heads, dk, dv, int(tiled), start[0].data_ptr() if start else None, start[1].data_ptr() if start else None,
        keep, conv_ptrs, ssm_ptrs, out.data_ptr(), torch.get_num_threads(),
    )
    kernel_abi.raise_for_status(rc, "gated_delta_window")
    return out


class GatedDeltaNet(nn.Module):
    """A hybrid model's linear-attention layer; `forward` has `Attention.forward`'s signature."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        lin = config.linear
        assert lin is not None and layer_idx in lin.layers
        self.state_layer = lin.layers.index(layer_idx)  # its index among the model's linear layers
        self.num_k_heads, self.num_v_heads = lin.num_key_heads, lin.num_value_heads
        self.head_k_dim, self.head_v_dim = lin.key_head_dim, lin.value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = lin.key_dim, lin.value_dim, lin.conv_dim
        self.kernel = lin.conv_kernel
        hidden = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.split, self.tiled = lin.split_projections, lin.tiled_value_heads
        if self.split:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            # b and a set each head's write strength and decay: a few rows, kept dense (`keep_dense`)
            self.in_proj_b = DenseLinear(hidden, self.num_v_heads, bias=False)
            self.in_proj_a = DenseLinear(hidden, self.num_v_heads, bias=False)
        else:  # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = DenseLinear(hidden, 2 * self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.c_kernel_fits = True  # no paged attention here: nothing for the C attention to fall back from

    def _per_value_head(self, t: torch.Tensor, r: int) -> torch.Tensor:  # [n, Hk, Dk] -> [n, Hv, Dk]
        return t.repeat(1, r, 1) if self.tiled else t.repeat_interleave(r, dim=1)

    def _project(self, x: torch.Tensor):
        """`[T, hidden]` -> q, k `[T, key_dim]`, v `[T, value_dim]`, z `[T, Hv, Dv]`, b, a `[T, Hv]`."""
        if not self.split:
            return self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q, k, v, self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim), self.in_proj_b(x), self.in_proj_a(x)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """transformers' `fix_query_key_value_ordering` on `[T, ...]`: Qwen3-Next's projections are
        grouped by key head (each holding its q, k and its value heads' v and z)."""
        t, hk, r = qkvz.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        dk, dv = self.head_k_dim, self.head_v_dim
        q, k, v, z = qkvz.view(t, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        return (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), z.reshape(t, self.num_v_heads, dv),
                b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation,  # unused: no positions in a recurrence
        kv_cache,  # unused: the states live in meta.states
        layer_idx: int,
        meta: AttentionMetadata,
        norm: RMSNorm | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        states = meta.states
        if states is None:
            raise RuntimeError("a linear-attention layer needs the runner's recurrent states (meta.states)")
        x = x if norm is None else norm(x)
        q, k, v, z, b, a = self._project(x)
        mixed = torch.cat([q, k, v], dim=-1)  # [T, C]
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight  # [C, 1, K]
        lib = load_kernel() if x.device.type == "cpu" and states.cache.spec.dtype == torch.float32 else None
        if lib is not None:
            return plus_linear(residual, self.out_proj, self._kernel_windows(lib, mixed, g, beta, z, meta))
        r = self.num_v_heads // self.num_k_heads
        out = torch.empty(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        hi = 0
        for w, n in enumerate(meta.query_lens_cpu):  # each window from its own state
            lo, hi = hi, hi + n
            keep = states.rows_kept(w)
            conv_state, ssm_state = states.read(w, self.state_layer)  # [C, K-1], [H, Dk, Dv]
            full = torch.cat([conv_state.to(weight.dtype), mixed[lo:hi].t().to(weight.dtype)], dim=-1)  # [C, K-1+n]
            conv = F.silu(F.conv1d(full[None], weight, groups=self.conv_dim)[0]).to(x.dtype).t()  # [n, C]
            width = self.kernel - 1
            conv_kept = torch.stack([full[:, i + 1 : i + 1 + width] for i in range(n - keep, n)]) if keep else None
            qw, kw, vw = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            qw, kw = (self._per_value_head(t.reshape(n, self.num_k_heads, self.head_k_dim), r) for t in (qw, kw))
            vw = vw.reshape(n, self.num_v_heads, self.head_v_dim)
            o, ssm_kept = gated_delta_rule(qw, kw, vw, g[lo:hi], beta[lo:hi], ssm_state, keep)
            out[lo:hi] = o.to(x.dtype)
            if keep:
                states.write(w, self.state_layer, conv_kept, ssm_kept)
        core = self.norm(out, z).reshape(x.shape[0], self.value_dim)
        return plus_linear(residual, self.out_proj, core)

    def _kernel_windows(self, lib: ctypes.CDLL, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        z: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every window's convolution and recurrence in C, reading and writing the state ring in
        place; the gated norm of the outputs `[T, value_dim]`."""
        states = meta.states
        weight = self.conv1d.weight.detach().reshape(self.conv_dim, self.kernel).float().contiguous()
        mixed, g, beta = mixed.float().contiguous(), g.float().contiguous(), beta.float().contiguous()
        outs, hi = [], 0
        for w, n in enumerate(meta.query_lens_cpu):
            lo, hi = hi, hi + n
            start, conv_out, ssm_out = states.entries(w, self.state_layer)
            outs.append(gated_delta_window_c(lib, mixed[lo:hi], weight, g[lo:hi], beta[lo:hi], self.num_k_heads,
                                             self.head_k_dim, self.head_v_dim, self.tiled, start, conv_out, ssm_out))
        out = (outs[0] if len(outs) == 1 else torch.cat(outs)).to(z.dtype)
        return self.norm(out, z).reshape(z.shape[0], self.value_dim)
