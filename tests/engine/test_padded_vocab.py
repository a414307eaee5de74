"""Draft and target vocabularies that differ only by padding (Qwen2.5-7B: 152,064 ids, 0.5B: 151,936).

The draft's runner puts out logits over the target's vocabulary, -inf at the ids it lacks (or cut
where it has more), so speculative output stays the target's: greedy token for token, sampled in
distribution. A real tokenizer mismatch is refused, naming the ids that differ.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.engine_parts import (
    MAX_VOCAB_PADDING,
    TokenizerMismatchError,
    check_same_tokenizer,
)
from specdec.sampling_params import SamplingParams
from specdec.testing import from_hf, tiny_hf_model, tiny_tokenizer

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TARGET_VOCAB, DRAFT_VOCAB = 128, 96  # ids 96..127: the target's padding


def _cut_vocab(hf_model, vocab: int):
    """The same network with only the first `vocab` rows of its embedding and LM head."""
    cut = tiny_hf_model("llama", seed=0, vocab_size=vocab)
    state = {
        k: (v[:vocab] if k in ("model.embed_tokens.weight", "lm_head.weight") else v)
        for k, v in hf_model.state_dict().items()
    }
    cut.load_state_dict(state)
    return cut


@pytest.fixture(scope="module")
def hf_target():
    return tiny_hf_model("llama", seed=0, vocab_size=TARGET_VOCAB)


@pytest.fixture(scope="module")
def reference(hf_target):
    engine = make_engine(from_hf(hf_target))
    outs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert any(t >= DRAFT_VOCAB for o in outs for t in o), "the target should emit padding ids too"
    return outs


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_smaller_draft_vocab_greedy_equals_target_only(hf_target, reference, proposer, k):
    draft = from_hf(tiny_hf_model("llama", seed=1, vocab_size=DRAFT_VOCAB, num_hidden_layers=1))
    engine = make_engine(from_hf(hf_target), draft, proposer=proposer, num_speculative_tokens=k)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0


def test_cut_copy_of_the_target_accepts_every_draft():
    """The target without its padding rows as the draft: every draft is the target's own argmax.

    The target's padding rows are zero, as in a padded checkpoint: it never picks those ids.
    """
    hf_target = tiny_hf_model("llama", seed=0, vocab_size=TARGET_VOCAB)
    with torch.no_grad():
        hf_target.lm_head.weight[DRAFT_VOCAB:] = 0
    reference = [o.token_ids for o in make_engine(from_hf(hf_target)).generate(PROMPTS, GREEDY)]
    draft = from_hf(_cut_vocab(hf_target, DRAFT_VOCAB))
    engine = make_engine(from_hf(hf_target), draft, num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    runner = engine.proposer.runner
    assert (runner.model_vocab, runner.output_vocab) == (DRAFT_VOCAB, TARGET_VOCAB)
    assert engine.stats.acceptance_rate == 1.0


def test_larger_draft_vocab_greedy_equals_target_only(hf_target, reference):
    """The reverse: the draft pads (its logits are cut to the target's vocabulary)."""
    draft = from_hf(tiny_hf_model("llama", seed=1, vocab_size=TARGET_VOCAB + 64, num_hidden_layers=1))
    engine = make_engine(from_hf(hf_target), draft, num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.stats.num_draft_tokens > 0


def test_draft_runner_pads_with_minus_inf(hf_target):
    draft = from_hf(tiny_hf_model("llama", seed=1, vocab_size=DRAFT_VOCAB, num_hidden_layers=1))
    engine = make_engine(from_hf(hf_target), draft, num_speculative_tokens=2)
    out = engine.proposer.propose  # drafts' q over the target's vocabulary, zero at padding ids
    seen = []
    engine.proposer.propose = lambda *a, **kw: (o := out(*a, **kw), seen.append(o))[0]
    engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=0))
    probs = [o.probs for o in seen if o.probs is not None]
    assert probs and all(p.shape[-1] == TARGET_VOCAB for p in probs)
    assert all(float(p[..., DRAFT_VOCAB:].abs().sum()) == 0.0 for p in probs)


def test_vocab_sizes_further_apart_than_padding_are_refused(hf_target):
    draft = from_hf(tiny_hf_model("llama", seed=1, vocab_size=TARGET_VOCAB + MAX_VOCAB_PADDING + 1))
    with pytest.raises(TokenizerMismatchError, match="differ by more than padding"):
        make_engine(from_hf(hf_target), draft)


V, PAD = 4, 2  # the target has 2 ids the draft lacks, with real probability
PROMPT = [3, 1, 2]
N = 4000
TV_TOLERANCE = 0.05  # sampling noise for 36 outcomes at N=4000 is about 0.02


def test_sampled_output_distribution_is_the_targets():
    """The target's mass at the draft's padding ids comes back through the residual max(0, p - q)."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=V + PAD)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=V, num_hidden_layers=1)
    engine = make_engine(from_hf(hf_target), from_hf(hf_draft), num_speculative_tokens=3,
                         max_num_seqs=N, num_blocks=3 * N, block_size=4)
    torch.manual_seed(0)
    outs = engine.generate([PROMPT] * N, params)
    counts = torch.zeros(V + PAD, V + PAD)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1

    def dist(ids):
        with torch.no_grad():
            return torch.softmax(hf_target(torch.tensor([ids])).logits[0, -1].float(), -1)

    p1 = dist(PROMPT)
    exact = torch.stack([p1[x] * dist(PROMPT + [x]) for x in range(V + PAD)])  # [V+PAD, V+PAD]
    tv = 0.5 * (counts / N - exact).abs().sum().item()
    assert tv < TV_TOLERANCE, f"total variation {tv:.4f}"
    assert counts[:, V:].sum() > 0.05 * N  # after a speculative step: the residual emitted them
    assert 0.02 < engine.stats.acceptance_rate < 0.98


# Tokenizers, through the loader: folders on disk as `--target DIR --draft DIR` would pass them.


def _write_model(path, tokenizer, vocab_size: int, layers: int, seed: int):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_hf_model("qwen2", seed, vocab_size=vocab_size, eos_token_id=eos, bos_token_id=None,
                          num_hidden_layers=layers)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _swapped(tokenizer, a: int, b: int):
    """The same tokenizer with the tokens of ids `a` and `b` swapped: a real mismatch."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    token_a, token_b = (next(t for t, i in vocab.items() if i == x) for x in (a, b))
    vocab[token_a], vocab[token_b] = b, a
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    return swapped, token_a, token_b


def _file_config(target, draft, **overrides) -> EngineConfig:
    kwargs = dict(target=str(target), draft=str(draft), proposer="draft", dtype="float32",
                  device="cpu", num_blocks=64, block_size=4, adaptive_k=False,
                  num_speculative_tokens=3, target_quant="none", draft_quant="none")
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


def test_padded_pair_from_folders_runs_speculatively(tmp_path):
    tokenizer = tiny_tokenizer()
    target = _write_model(tmp_path / "target", tokenizer, len(tokenizer) + 64, 2, seed=0)
    draft = _write_model(tmp_path / "draft", tokenizer, len(tokenizer), 1, seed=1)
    prompts = ["def quicksort(xs):", "The quick brown fox"]
    reference = Engine(_file_config(target, draft, proposer="none")).generate(prompts, GREEDY)
    engine = Engine(_file_config(target, draft))
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert engine.stats.num_draft_tokens > 0


def test_tokenizer_that_extends_the_other_is_accepted():
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    target_tok.add_tokens([f"<extra_{i}>" for i in range(8)])  # ids past the draft's last one
    check_same_tokenizer(target_tok, draft_tok, EngineConfig())
    check_same_tokenizer(draft_tok, target_tok, EngineConfig())


def test_real_tokenizer_mismatch_is_refused_naming_the_ids(tmp_path):
    tokenizer = tiny_tokenizer()
    a, b = 100, 200
    draft_tok, token_a, token_b = _swapped(tokenizer, a, b)
    target = _write_model(tmp_path / "target", tokenizer, len(tokenizer), 2, seed=0)
    draft = _write_model(tmp_path / "draft", draft_tok, len(tokenizer), 1, seed=1)
    with pytest.raises(TokenizerMismatchError) as info:
        Engine(_file_config(target, draft))
    message = str(info.value)
    assert "2 token ids differ" in message
    assert f"id {a} is {token_a!r} in the target, {token_b!r} in the draft" in message
    assert f"id {b} is {token_b!r} in the target, {token_a!r} in the draft" in message


def test_identical_tokenizer_files_are_read_once(tmp_path, monkeypatch):
    """A draft whose tokenizer files are the target's byte for byte (the default pair's) is not
    loaded a second time; files that differ at all are loaded and compared as before."""
    from specdec import engine_parts

    tokenizer = tiny_tokenizer()
    target = _write_model(tmp_path / "target", tokenizer, len(tokenizer), 2, seed=0)
    draft = _write_model(tmp_path / "draft", tokenizer, len(tokenizer), 1, seed=1)
    assert engine_parts.same_tokenizer_files(target, draft)
    loads = []
    real = engine_parts.load_tokenizer
    monkeypatch.setattr(engine_parts, "load_tokenizer", lambda folder: loads.append(folder) or real(folder))
    _, draft_model, _ = engine_parts.load_engine_parts(_file_config(target, draft))
    assert loads == [target] and draft_model is not None
    config = json.loads((draft / "tokenizer_config.json").read_text())
    (draft / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert not engine_parts.same_tokenizer_files(target, draft)
    loads.clear()
    engine_parts.load_engine_parts(_file_config(target, draft))
    assert loads == [target, draft]
