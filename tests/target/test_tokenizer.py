"""Streaming detokenization and chat templates (specdec.target.tokenizer), tiny local tokenizer."""

from __future__ import annotations

import random

import pytest

from specdec.target.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    is_chat_model,
    load_tokenizer,
)

from .conftest import CORPUS

TEXT = "".join(CORPUS) + " ünïcödé 🚀🤖 日本 " + "x = [i * 2 for i in range(10)]\n"


def _stream(tokenizer, prompt_ids: list[int], ids: list[int], rng: random.Random) -> list[str]:
    """Feed `ids` in random chunks of 0..4 ids; return what each step emitted."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 4)
        chunks.append(detok.step(ids[i : i + n]))
        i += n
    assert "".join(chunks) == detok.text
    return chunks


@pytest.mark.parametrize("seed", range(20))
def test_streamed_text_equals_full_decode(tiny_tokenizer, seed):
    rng = random.Random(seed)
    eos = tiny_tokenizer.eos_token_id
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    cut = rng.randint(1, len(ids))
    while tiny_tokenizer.decode(ids[:cut]).endswith("\ufffd"):  # end on a whole character
        cut += 1
    ids = ids[:cut]
    ids.insert(rng.randint(0, len(ids)), eos)  # special tokens are skipped wherever they fall
    prompt_ids = tiny_tokenizer.encode(CORPUS[seed % len(CORPUS)], add_special_tokens=False)
    chunks = _stream(tiny_tokenizer, prompt_ids, ids, rng)
    assert "".join(chunks) == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def test_character_split_across_tokens_is_held_back(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the tiny vocabulary should split the emoji into byte tokens"
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    emitted = [detok.step([i]) for i in ids]
    assert emitted[:-1] == [""] * (len(ids) - 1)  # never a half character (no '\ufffd')
    assert emitted[-1] == "🚀"


def test_no_replacement_char_is_ever_emitted(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    assert all("\ufffd" not in detok.step([i]) for i in ids)


def test_prompt_is_not_emitted(tiny_tokenizer):
    prompt_ids = tiny_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt_ids)
    ids = tiny_tokenizer.encode(" jumps", add_special_tokens=False)
    assert "".join(detok.step([i]) for i in ids) == " jumps"


def test_each_step_decodes_a_bounded_window(tiny_tokenizer):
    """O(window) per call: the decoded slices stay short however long the output grows."""
    lengths: list[int] = []

    class Spy:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tiny_tokenizer.decode(ids, **kwargs)

    ids = tiny_tokenizer.encode(TEXT * 10, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), list(range(3, 40)))
    for i in ids:
        detok.step([i])
    assert len(ids) > 500 and max(lengths) < 30
    assert detok.text == tiny_tokenizer.decode(ids)


def test_empty_step_emits_nothing(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    assert detok.step([]) == "" and detok.text == ""


def test_chat_template_wraps_a_user_message(tiny_tokenizer):
    ids = apply_chat_template(tiny_tokenizer, "hi")
    assert is_chat_model(tiny_tokenizer)
    assert tiny_tokenizer.decode(ids) == "<s>user: hi</s><s>assistant: "


def test_no_chat_template_suggests_no_chat(plain_tokenizer):
    assert not is_chat_model(plain_tokenizer)
    with pytest.raises(ValueError, match="--no-chat"):
        apply_chat_template(plain_tokenizer, "hi")


def test_load_tokenizer_round_trip(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(TEXT) == tiny_tokenizer.encode(TEXT)
    assert is_chat_model(loaded)


def test_load_tokenizer_from_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(tmp_path)
