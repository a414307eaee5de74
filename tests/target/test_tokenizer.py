"""Streaming detokenization and chat templates (specdec.target.tokenizer), tiny local tokenizer."""

from __future__ import annotations

import random

import pytest

from specdec.target.tokenizer import (
    HARMONY_ENDS,
    HARMONY_MARKERS,
    IncrementalDetokenizer,
    apply_chat_template,
    end_of_answer_ids,
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


def test_harmony_markers_stay_in_the_text_and_its_ends_stop(tiny_tokenizer):
    """gpt-oss's vocabulary: the message markers are kept as text (the answer is read by them),
    other special tokens are still skipped, and `<|return|>` / `<|call|>` end an answer."""
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    assert end_of_answer_ids(plain) == ()
    harmony = copy.deepcopy(tiny_tokenizer)
    harmony.add_special_tokens({"additional_special_tokens": [*HARMONY_MARKERS, *HARMONY_ENDS]})
    answer = "<|channel|>analysis<|message|>Hm, ünï.<|end|><|start|>assistant<|channel|>final<|message|>x = 1"
    ids = harmony.encode(answer, add_special_tokens=False) + [harmony.eos_token_id]  # skipped
    for seed in range(5):
        assert "".join(_stream(harmony, [], ids, random.Random(seed))) == answer
    assert "".join(_stream(plain, [], plain.encode("Hm<|end|>", add_special_tokens=False), random.Random(0))) == "Hm<|end|>"
    assert end_of_answer_ids(harmony) == tuple(harmony.convert_tokens_to_ids(t) for t in HARMONY_ENDS)


def test_an_engine_stops_at_harmony_ends(tiny_tokenizer):
    """`<|call|>` ends a gpt-oss answer though the config's EOS is another token (as
    generation_config.json lists it); not emitted as text."""
    import copy

    from specdec.config import EngineConfig
    from specdec.engine import Engine
    from specdec.sampling_params import SamplingParams
    from specdec.testing import tiny_pair

    harmony = copy.deepcopy(tiny_tokenizer)
    harmony.add_special_tokens({"additional_special_tokens": [*HARMONY_MARKERS, *HARMONY_ENDS]})
    call = harmony.convert_tokens_to_ids("<|call|>")
    target, _ = tiny_pair("qwen2", 0, vocab_size=len(harmony), eos_token_id=2, bos_token_id=None)
    engine = Engine.from_models(EngineConfig(device="cpu", num_speculative_tokens=0), target, None, harmony)
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={call: 100})
    (out,) = engine.generate([[5, 6, 7]], params)
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [], "")
