"""Fixtures for specdec.target tests: a tiny byte-level BPE tokenizer trained here, no downloads."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
# Multi-byte UTF-8 (accents, CJK, emoji) so that characters get split across byte-level tokens.
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding: the draft proposes, the target verifies.",
    "naïve café déjà vu — “quoted” text",
    "日本語のテキストと中文字符",
    "emoji 🤖🎉🚀 and more 🤖",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def build_tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE, vocab_size: int = 320):
    """A `PreTrainedTokenizerFast` with a byte-level BPE (GPT-2 / Qwen style) trained on CORPUS.

    With a small vocabulary most non-ASCII characters stay split into byte tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def plain_tokenizer():
    """The same tokenizer without a chat template (a base model's)."""
    return build_tiny_tokenizer(chat_template=None)


def add_gguf_tokenizer(writer, tokenizer) -> None:
    """Write `tokenizer` (a byte-level BPE) into a `gguf.GGUFWriter` as llama.cpp does ("gpt2")."""
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t, _ in vocab])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
