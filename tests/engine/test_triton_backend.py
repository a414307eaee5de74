"""The GPU path's attention, end to end without a GPU: the engine on the Triton backend
(`attention_backend="triton"`, the kernel run by Triton's interpreter on the CPU) against the
torch reference backend, on tiny random models. Each case compares the two backends' tokens and
logprobs (the verify pass's logits): speculative greedy decoding (fixed and adaptive k, with
rollback of rejected drafts), prefix-cache hits and chunked prefill beside a decoding stream,
sliding-window and soft-capped layers, fp8 KV, n > 1 on shared prompt blocks, seeded sampling,
and a short statistical check of the output distribution.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything compiles a Triton kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec.cache.attention import check_backend  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.testing import from_hf, tiny_hf_model, tiny_pair  # noqa: E402
from specdec.cache.triton_attention import triton_available  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_available() or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="triton is not installed (pip install 'specdec[triton]'), or TRITON_INTERPRET was unset",
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def _engine(pair, backend: str, **overrides) -> Engine:
    kwargs = dict(dtype="float32", num_blocks=64, block_size=4, proposer="draft", adaptive_k=False,
                  num_speculative_tokens=4, attention_backend=backend) | overrides
    if kwargs["proposer"] == "none":
        pair = (pair[0], None)
    return Engine.from_models(EngineConfig(**kwargs), *pair)


def _both(pair, prompts, params, **overrides):
    """(triton outputs, torch outputs) of the same requests on two engines that differ only in
    the attention backend."""
    return tuple(_engine(pair, backend, **overrides).generate(prompts, params) for backend in ("triton", "torch"))


def _assert_same(triton_outs, torch_outs):
    """The same tokens, and logprobs equal to fp32 rounding (the kernels sum in other orders)."""
    for a, b in zip(triton_outs, torch_outs):
        assert a.token_ids == b.token_ids
        lp_a = torch.tensor([e.logprob for e in a.logprobs])
        lp_b = torch.tensor([e.logprob for e in b.logprobs])
        torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama")


def test_the_triton_backend_actually_runs(pair, monkeypatch):
    """Every attention call of a step goes to the Triton kernel (none to the reference)."""
    import specdec.cache.attention as attention

    calls = {"triton": 0, "ref": 0}
    real_triton, real_ref = attention.paged_attention_triton, attention.paged_attention_ref
    monkeypatch.setattr(attention, "paged_attention_triton",
                        lambda *a, **k: calls.__setitem__("triton", calls["triton"] + 1) or real_triton(*a, **k))
    monkeypatch.setattr(attention, "paged_attention_ref",
                        lambda *a, **k: calls.__setitem__("ref", calls["ref"] + 1) or real_ref(*a, **k))
    _engine(pair, "triton").generate(PROMPTS[:1], GREEDY)
    assert calls["triton"] > 0 and calls["ref"] == 0, calls


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
def test_speculative_greedy_equals_target_only_and_the_torch_backend(pair, adaptive):
    triton_spec, torch_spec = _both(pair, PROMPTS, GREEDY, adaptive_k=adaptive)
    _assert_same(triton_spec, torch_spec)
    plain = _engine(pair, "triton", proposer="none").generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in triton_spec] == [o.token_ids for o in plain]
    stats = [o.stats for o in triton_spec]
    drafted = sum(s.num_draft_tokens for s in stats)
    assert drafted and sum(s.num_accepted_tokens for s in stats) < drafted  # rejections rolled back


def test_prefix_cache_hits_and_chunked_prefill_beside_a_decoding_stream(pair):
    """A long prompt prefilled in chunks of 8 while another stream decodes; then a request that
    shares the long prompt's first 24 tokens starts on its cached blocks."""
    long_prompt = list(range(30, 70))
    overrides = dict(max_num_batched_tokens=12, max_prefill_chunk=8, num_blocks=96)
    results = {}
    for backend in ("triton", "torch"):
        engine = _engine(pair, backend, **overrides)
        first = engine.generate([PROMPTS[0], long_prompt], GREEDY)
        second = engine.generate([long_prompt[:24] + [90, 91]], GREEDY)
        assert second[0].num_cached_tokens == 24
        results[backend] = first + second
    _assert_same(results["triton"], results["torch"])


@pytest.mark.parametrize("arch", ["gemma2", "mistral-window"], ids=["softcap+window", "sliding-window"])
def test_sliding_window_and_soft_capped_layers(arch):
    """Windows of 4 (prompts of up to 11 tokens pass them) and Gemma 2's soft-capping."""
    from tests.target.test_architectures import hf_model

    target, draft = from_hf(hf_model(arch, 0)), from_hf(hf_model(arch, 1, num_hidden_layers=1))
    attention = [layer.self_attn for layer in target.model.layers]
    assert any(a.window for a in attention) and (arch != "gemma2" or all(a.softcap for a in attention))
    _assert_same(*_both((target, draft), PROMPTS, GREEDY))


def test_fp8_kv_cache(pair):
    _assert_same(*_both(pair, PROMPTS, GREEDY, kv_dtype="fp8"))


def test_n_samples_share_the_prompt_blocks(pair):
    """Three seeded samples of one 30-token prompt: the siblings start on the first one's cached
    blocks, and each backend samples the same tokens."""
    prompt = list(range(10, 40))
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s, ignore_eos=True, logprobs=1) for s in (1, 2, 3)]
    results = {}
    for backend in ("triton", "torch"):
        engine = _engine(pair, backend, num_speculative_tokens=3, num_blocks=128)
        first = engine.add_request(prompt, params[0])
        others = [engine.add_request(prompt, p, share_prompt_with=first) for p in params[1:]]
        while engine.has_unfinished():
            engine.step()
        sequences = [engine._sequences[rid] for rid in (first, *others)]
        assert [s.num_cached_tokens for s in sequences[1:]] == [28, 28]
        results[backend] = [engine.output(s) for s in sequences]
    _assert_same(results["triton"], results["torch"])
    assert len({tuple(o.token_ids) for o in results["triton"]}) == 3


def test_seeded_sampling_matches_the_torch_backend(pair):
    params = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=s, logprobs=1) for s in range(6)]
    triton_engine, torch_engine = _engine(pair, "triton"), _engine(pair, "torch")
    for p in params:
        _assert_same(triton_engine.generate(PROMPTS[:1], p), torch_engine.generate(PROMPTS[:1], p))


def test_sampled_first_token_follows_the_targets_distribution():
    """500 requests at temperature 1 on an 8-token vocabulary in one batch on the Triton backend
    (a speculative engine, k = 3): the first token's frequencies are within sampling noise of the
    target's softmax (total variation < 0.1; expected ~0.05 at this N). The first token comes from
    the batched prefill's logits (every one of the 500: a prefill step does not draft), so one
    token a request is all this checks; the verify steps' exactness on this backend: the seeded
    and greedy tests above (bitwise the torch backend's), whose distribution test_losslessness
    checks."""
    hf_target = tiny_hf_model("llama", seed=3, vocab_size=8)
    hf_draft = tiny_hf_model("llama", seed=4, vocab_size=8, num_hidden_layers=1)
    engine = _engine((from_hf(hf_target), from_hf(hf_draft)), "triton", num_speculative_tokens=3,
                     max_num_seqs=500, num_blocks=1500)
    torch.manual_seed(0)
    outs = engine.generate([[3, 5, 1]] * 500, SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True))
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=8).float()
    with torch.no_grad():
        exact = hf_target(torch.tensor([[3, 5, 1]])).logits[0, -1].softmax(-1)
    tv = 0.5 * (counts / 500 - exact).abs().sum().item()
    assert tv < 0.1, tv


def test_a_backend_that_cannot_run_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_backend("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    check_backend("c", "cpu")
    with pytest.raises(ValueError, match="'c' is the CPU kernel"):
        check_backend("c", "meta")
