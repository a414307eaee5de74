"""Tiny random models for tests and smoke runs (no downloads): transformers twins of our model."""

from __future__ import annotations

import contextlib
import copy

import torch

from specdec.target.config import ModelConfig
from specdec.target.model import LlamaForCausalLM
from specdec.target.moe import split_stacked_experts

TINY_VOCAB = 96


def tiny_hf_config(arch: str = "llama", vocab_size: int = TINY_VOCAB, **overrides):
    """A small transformers config of the given family ('llama', 'qwen2' or 'mistral')."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = cls(**kwargs)
    config.architectures = [f"{cls.__name__.replace('Config', '')}ForCausalLM"]
    return config


def tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers causal LM in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # sharper logits than the default init, so greedy/sampling are not flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.eval()


def from_hf(hf_model, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Our model with the same weights as a transformers model."""
    config = ModelConfig.from_hf(hf_model.config)
    model = LlamaForCausalLM(config)
    state = split_stacked_experts({k.replace(".mlp.shared_experts.", ".mlp.shared_expert."): v  # DeepSeek's name
                                   for k, v in hf_model.state_dict().items() if "rotary_emb" not in k})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    return model.to(dtype).eval()


def tiny_pair(arch: str = "llama", seed: int = 0, **overrides):
    """(target, draft) of our model class sharing a vocabulary; the draft is a different random net."""
    target = from_hf(tiny_hf_model(arch, seed, **overrides))
    draft = from_hf(tiny_hf_model(arch, seed + 1, num_hidden_layers=1, **overrides))
    return target, draft


# ChatML; with `tools`, a system block listing them and assistant tool calls in Qwen2.5's format
# (plain conversations render exactly as before).
TINY_CHAT_TEMPLATE = (  # transformers renders with trim_blocks: a newline after a tag is written as {{ nl }}
    "{% set nl = '\\n' %}"
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ nl }}{{ t | tojson }}{% endfor %}{{ nl }}"
    "</tools><|im_end|>{{ nl }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}{% if m['content'] %}{{ nl }}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] %}{{ nl }}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "{% else %}{{ nl }}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé — ☃ 日本語 🙂",
    "Speculative decoding: a draft proposes, the target verifies.",
    "for i in range(10):\n    print(i * i)\n",
]


def tiny_tokenizer(vocab_size: int = 384, tool_tokens: bool = False):
    """A byte-level BPE tokenizer trained here on a few lines, with a ChatML template and specials;
    `tool_tokens`: `<tool_call>` and `</tool_call>` are single (added, not special) tokens after
    them, as in Qwen2.5's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    if tool_tokens:
        fast.add_tokens(["<tool_call>", "</tool_call>"])
    return fast


def tiny_engine_parts(seed: int = 0, tool_tokens: bool = False, max_len: int = 512):
    """(target, draft, tokenizer): a tiny random pair whose vocabulary is the tiny tokenizer's
    (`tool_tokens`: see `tiny_tokenizer`), with a context of `max_len` positions."""
    tokenizer = tiny_tokenizer(tool_tokens=tool_tokens)
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target, draft = tiny_pair("qwen2", seed, vocab_size=vocab, eos_token_id=eos, bos_token_id=None,
                              max_position_embeddings=max_len)
    return target, draft, tokenizer


def write_tiny_pair(root, seed: int = 0):
    """Save a tiny random (target, draft) pair as HF folders with the tiny tokenizer; returns paths.

    The CLI, server and eval smoke tests run `--target <dir> --draft <dir>` on these.
    """
    from pathlib import Path

    root = Path(root)
    tokenizer = tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    paths = []
    for name, layers, s in (("target", 2, seed), ("draft", 1, seed + 1)):
        model = tiny_hf_model(
            "qwen2", s, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
            num_hidden_layers=layers,
        )
        out = root / name
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        paths.append(out)
    return paths[0], paths[1]


def noisy_twin(model: torch.nn.Module, sigma: float = 0.006, seed: int = 0) -> torch.nn.Module:
    """A draft that agrees with `model` about half the time (greedy), so every token origin shows up:
    accepted drafts, corrections by the target and bonus tokens."""
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * sigma)
    return twin


def pace_steps(engine, seconds: float):
    """`engine` with every `step()` delayed by `seconds` (a tiny engine otherwise finishes before a
    test can act mid-request: disconnect, kill a replica); returns it."""
    import time

    step = engine.step

    def paced_step():
        time.sleep(seconds)
        return step()

    engine.step = paced_step
    return engine


def tiny_serving_engine(seed: int = 0, **overrides):
    """A fresh Engine over the tiny pair (a draft that agrees about half the time), as the server
    tests build it; importable by name, so a Ray replica can build one (`functools.partial`)."""
    from specdec.config import EngineConfig
    from specdec.engine import Engine

    target, _, tokenizer = tiny_engine_parts(seed)
    kwargs = dict(dtype="float32", num_blocks=256, block_size=8, num_speculative_tokens=4, max_num_seqs=16)
    kwargs.update(overrides)
    return Engine.from_models(EngineConfig(**kwargs), target, noisy_twin(target), tokenizer)


HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Count the reads of tensor values by Python (`.item()`, `.tolist()`, `.numpy()`, `bool()` /
    `int()` / `float()` / indexing by a tensor): on CUDA each is a device-to-host sync. Yields a
    `collections.Counter` of `(method, caller "file:function")`. What C++ ops sync inside torch
    (`nonzero`, boolean masks) is not seen here: `torch.cuda.set_sync_debug_mode` sees those on a GPU.

        >>> with count_host_reads() as reads:
        ...     _ = torch.ones(2).sum().item()
        >>> sum(reads.values())
        1
    """
    import collections
    import sys as _sys

    import torch

    reads: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name, fn):
        def read(self, *args, **kwargs):
            frame = _sys._getframe(1)
            reads[(name, f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")] += 1
            return fn(self, *args, **kwargs)
        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield reads
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
