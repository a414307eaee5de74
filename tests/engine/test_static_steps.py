"""The engine on bucketed static-shape steps (`bucketed_steps`: the path `--cuda-graphs` captures,
run eagerly on the CPU) decodes what it decodes on plain steps, token for token and logprob for
logprob; `cuda_graphs` is checked; and a step reads device values on the host once."""

from __future__ import annotations

import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.testing import count_host_reads, tiny_pair

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.fixture(scope="module")
def bf16_pair():
    """bf16: the CPU's bf16 matmul gives each row the same bits whatever the rows beside it (its
    fp32 one does not for 3..11 rows: `tests/target/test_static_step.py`)."""
    return tuple(m.to(torch.bfloat16) for m in tiny_pair("llama"))


def _engine(pair, proposer: str, bucketed: bool, **overrides) -> Engine:
    config = EngineConfig(dtype="bfloat16", num_blocks=96, block_size=4, proposer=proposer, adaptive_k=False,
                          num_speculative_tokens=3, attention_backend="torch", bucketed_steps=bucketed, **overrides)
    return Engine.from_models(config, pair[0], pair[1] if proposer == "draft" else None)


@pytest.mark.parametrize("proposer", ["none", "draft", "ngram"])
def test_bucketed_steps_decode_the_plain_steps_tokens_and_logprobs(bf16_pair, proposer):
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=1)]
    runs = []
    for bucketed in (False, True):
        engine = _engine(bf16_pair, proposer, bucketed)
        outs = engine.generate(PROMPTS, params[0]) + engine.generate(PROMPTS[:2], params[1])
        runs.append([(o.token_ids, [(e.token_id, e.logprob) for e in o.logprobs or []]) for o in outs])
        steps = engine.target.static_steps
        assert (steps is None) != bucketed and (not bucketed or steps.steps["bucketed"] > 10)
        assert engine.target.pool.num_free == engine.target.pool.num_blocks
    assert runs[0] == runs[1]


def test_cuda_graphs_is_checked_and_auto_is_off_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine takes --cuda-graphs on")
    with pytest.raises(ValueError, match="cuda_graphs 'on' needs a CUDA device; this engine runs on cpu"):
        EngineConfig(cuda_graphs="on")
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        EngineConfig(cuda_graphs="always")
    assert EngineConfig().static_steps == "off" and EngineConfig(cuda_graphs="off").static_steps == "off"
    assert EngineConfig(bucketed_steps=True).static_steps == "eager"


# Reads of tensors the sampler keeps on the host by design (temperatures, top-k / top-p, the
# drafts' counts `Verifier.accept` passes as a host tensor: `draft.base.SamplingTensors`), which a
# CPU-only run cannot tell from device reads
HOST_KEPT = {"sampling.py:warp_probs", "sampling.py:_apply_top_k_top_p", "base.py:all_greedy",
             "rejection.py:_check_shapes", "rejection.py:_draw_uniforms"}


@pytest.mark.parametrize("bucketed", [False, True])
@pytest.mark.parametrize("proposer", ["none", "draft"])
def test_a_decode_step_reads_the_device_once(bf16_pair, proposer, bucketed):
    """Steady decoding (greedy and sampled rows; speculative: k draft forwards and one verify):
    one read of device values a step, the accepted tokens and counts together. A `.item()` or
    `.tolist()` of a device tensor added anywhere in the step fails this."""
    engine = _engine(bf16_pair, proposer, bucketed)
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=40, ignore_eos=True))
    for _ in range(3):  # prefill, then decoding
        engine.step()
    for _ in range(3):
        with count_host_reads() as reads:
            engine.step()
        device_reads = {key: n for key, n in reads.items() if key[1] not in HOST_KEPT}
        assert device_reads == {("tolist", "engine.py:_step"): 1}, dict(reads)


def test_the_counter_sees_a_read():
    with count_host_reads() as reads:
        torch.ones(3).sum().item()
        [int(x) for x in torch.arange(2)]
    assert reads[("item", "test_static_steps.py:test_the_counter_sees_a_read")] == 1
    assert sum(reads.values()) == 3
