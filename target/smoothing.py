"""SmoothQuant: move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose the small channels of a row whose range is set by a few outlier
channels. For a linear fed by `x`, `y = (x / s) @ (W * s).T` is the same function for any positive
per-input-channel `s`; with `s_j = max|x_j|^a / max|W_j|^(1-a)` both factors become easier to
quantize (Xiao et al., 2023). The division by `s` is folded into whatever produces `x`, so there is
no run-time cost:

    q/k/v_proj   <- input_layernorm.weight           (RMSNorm scale)
    gate/up_proj <- post_attention_layernorm.weight
    down_proj    <- up_proj output rows              (x = silu(gate) * up is linear in up)
    o_proj       <- v_proj output rows (and bias)    (attention output is linear in v; one factor
                                                      per kv head channel, shared by its q heads)
    lm_head      <- model.norm.weight                (the head must be untied from the embedding)

`max|x_j|` comes from one forward over `CALIBRATION_TEXT` (code and prose, shipped here: nothing
is downloaded). Measured on Qwen2.5-Coder-1.5B against the dense bf16 model, teacher-forced: with
this text and a = 0.5, KL 0.009 nats/token and top-1 agreement 0.966 on 1,256 held-out tokens (3
HumanEval, 2 ShareGPT prompts); without smoothing, KL 0.021 / 0.962 on 400 tokens of code. The
calibration text matters: the same 400 tokens scored KL 0.012 with an earlier, shorter text and
0.007 with a calibration text resembling them.
"""

from __future__ import annotations

import torch
from torch import nn

ALPHA = 0.5

CALIBRATION_TEXT = r'''\
def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]


class LRUCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        value = self.items.pop(key, None)
        if value is not None:
            self.items[key] = value
        return value

import numpy as np
x = np.linspace(0, 2 * np.pi, 100)
print(f"mean={np.sin(x).mean():.3f}, max={np.cos(x).max()}")

User: Can you explain what a hash map is, and when I should use one instead of a list?
Assistant: A hash map stores key-value pairs and finds a value from its key in constant time on
average, because it computes where the key lives instead of searching for it. Use one when you
look things up by name or id; use a list when order matters or you only walk through the items.

The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined movable metal type, oil-based ink and a screw press. Within fifty years, presses were
running in more than two hundred cities across Europe, and the price of books fell sharply.

SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;

function debounce(fn, ms) { let t; return (...args) => { clearTimeout(t); t = setTimeout(() => fn(...args), ms); }; }

<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Write a function that returns the n-th Fibonacci number, and explain its complexity.<|im_end|>
<|im_start|>assistant
Here is an iterative version that runs in O(n) time and O(1) memory:

```python
def fib(n: int) -> int:
    if n < 0:
        raise ValueError("n must be non-negative")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
```

Each loop step does constant work, so the whole call costs n steps.<|im_end|>
<|im_start|>user
Thanks! Now make it recursive with memoization.<|im_end|>

from dataclasses import dataclass, field
from typing import Iterator
import re, os, json, itertools


@dataclass
class Token:
    kind: str
    text: str
    line: int = 0
    children: list["Token"] = field(default_factory=list)


TOKEN_RE = re.compile(r"\s*(?:(\d+\.?\d*)|(\w+)|(.))")


def tokenize(source: str) -> Iterator[Token]:
    for lineno, line in enumerate(source.splitlines(), 1):
        for number, name, op in TOKEN_RE.findall(line):
            if number:
                yield Token("NUM", number, lineno)
            elif name:
                yield Token("NAME", name, lineno)
            elif op.strip():
                yield Token("OP", op, lineno)


def load_config(path: str) -> dict:
    if not os.path.exists(path):
        return {"retries": 3, "timeout": 10.0, "hosts": ["localhost:8080"]}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


for a, b in itertools.product(range(3), "xy"):
    assert isinstance(a, int) and b in {"x", "y"}, (a, b)

#include <stdio.h>
int main(void) { int sum = 0; for (int i = 0; i < 100; ++i) sum += i * i; printf("%d\n", sum); return 0; }

Dear team, the quarterly report is attached. Revenue grew 12% over the previous quarter, driven
mostly by the new subscription plans, while costs stayed flat. Please review the numbers before
Thursday's meeting and send me your questions; I will collect them into a single document.

Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. In the chloroplasts,
chlorophyll absorbs mostly red and blue light, which is why leaves look green to us. 1, 2, 3, 5, 8,
13, 21, 34 -- 3.14159, 2.71828, 1.41421; e = mc^2; x_{n+1} = x_n - f(x_n) / f'(x_n).

Q: Wie spät ist es? R: Il est trois heures. 答：今天天气很好。 ¿Dónde está la estación?
'''


def signature() -> str:
    """Changes whenever the calibration text or alpha does (part of the cache key)."""
    import hashlib

    return hashlib.sha256(f"{ALPHA}|{CALIBRATION_TEXT}".encode()).hexdigest()[:12]


@torch.inference_mode()
def activation_absmax(model: nn.Module, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| `[K]` of every `nn.Linear`, over one forward of `token_ids`."""
    from specdec.target.runner import ModelRunner, Window

    stats: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module, inputs, output) -> None:
            amax = inputs[0].detach().float().abs().reshape(-1, inputs[0].shape[-1]).amax(0)
            stats[name] = torch.maximum(stats[name], amax) if name in stats else amax
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        block = 16
        runner = ModelRunner.build(model, block, None, num_blocks=(len(token_ids) + block - 1) // block + 1)
        table = runner.new_table()
        table.ensure_slots(len(token_ids))
        runner.forward([Window(table, token_ids, len(token_ids))])  # every row feeds the LM head
    finally:
        for h in handles:
            h.remove()
    return stats


def _factors(linears: list[nn.Linear], x_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    w_absmax = torch.stack([lin.weight.detach().float().abs().amax(0) for lin in linears]).amax(0)  # [K]
    s = x_absmax.clamp(min=1e-5) ** alpha / w_absmax.clamp(min=1e-5) ** (1 - alpha)
    return s.clamp(min=1e-5)  # [K]


def _scale_(param: torch.Tensor, factor: torch.Tensor) -> None:
    param.data = (param.data.float() * factor).to(param.dtype)


@torch.no_grad()
def smooth_model(model: nn.Module, token_ids: list[int], alpha: float = ALPHA) -> None:
    """Fold SmoothQuant factors into `model` in place (an fp32 model keeps it exact to fp32)."""
    if not token_ids:
        return
    if model.lm_head.weight is model.model.embed_tokens.weight:
        raise ValueError("untie the LM head from the embedding before smoothing it")
    stats = activation_absmax(model, token_ids[: model.max_positions])
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for norm, linears, name in (
            (layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj"),
            (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj"),
        ):
            s = _factors(linears, stats[prefix + name], alpha)
            _scale_(norm.weight, 1 / s)
            for lin in linears:
                _scale_(lin.weight, s)
        s = _factors([mlp.down_proj], stats[prefix + "mlp.down_proj"], alpha)
        _scale_(mlp.up_proj.weight, (1 / s)[:, None])
        _scale_(mlp.down_proj.weight, s)
        s = _factors([attn.o_proj], stats[prefix + "self_attn.o_proj"], alpha)
        s = s.view(cfg.num_kv_heads, group, cfg.head_dim).amax(1)  # [Hkv, D]: one per v channel
        _scale_(attn.v_proj.weight, (1 / s).reshape(-1, 1))
        if attn.v_proj.bias is not None:
            _scale_(attn.v_proj.bias, (1 / s).reshape(-1))
        _scale_(attn.o_proj.weight, s[:, None, :].expand(-1, group, -1).reshape(-1))
    s = _factors([model.lm_head], stats["lm_head"], alpha)
    _scale_(model.model.norm.weight, 1 / s)
    _scale_(model.lm_head.weight, s)
