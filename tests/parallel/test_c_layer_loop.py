"""A bf16 target on the C kernels (w4a8 tiles, the C layer loop) split over 2 ranks: the tensor-
parallel ranks' all-reduces run inside `decoder_layers`; pipeline stages are bitwise one process."""

from __future__ import annotations

import pytest
import torch

from specdec import Engine, EngineConfig, SamplingParams
from specdec.target.quant import decoder_stack

from .conftest import PROMPTS, prompt_logits, save_pair

pytestmark = pytest.mark.skipif(decoder_stack.kernel().unavailable_reason() is not None,
                                reason="the C layer loop is unavailable here")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("parallel-c"), (2, 3), (1, 4), scale=0.25,  # bf16 activations tame
                     hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def engine(pair, **kw) -> Engine:
    return Engine(EngineConfig(target=pair[0], draft=pair[1], dtype="bfloat16", target_quant="w4a8",
                               draft_quant="w4a8", num_blocks=64, **kw))


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_ranks_run_the_c_layer_loop(pair):
    one = engine(pair)
    ids = one.encode(PROMPTS[0] * 6)
    reference, tokens = prompt_logits(one, ids[:8]), [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    whole = prompt_logits(one, ids)
    one.close()
    assert len(ids) > 8  # a prompt chunk: the C loop too
    pp = engine(pair, pipeline_parallel_size=2)
    try:
        assert pp.target.model._layer_stack is not None
        assert torch.equal(prompt_logits(pp, ids[:8]), reference)  # stages: the same calls, bitwise
        assert [o.token_ids for o in pp.generate(PROMPTS, GREEDY)] == tokens
    finally:
        pp.close()
    tp = engine(pair, tensor_parallel_size=2)  # split exactly: every value one process's
    try:
        stack, comm = tp.target.model._layer_stack, tp.target.group.comm
        assert stack is not None and stack.comm is comm and comm.group is not None and comm.exact
        before = comm.num_all_reduces
        assert torch.equal(prompt_logits(tp, ids[:8]), reference)  # 8 rows: the C loop
        assert comm.num_all_reduces - before == 4 * 2 + 1  # 4 gathers a layer, the LM head
        assert torch.equal(prompt_logits(tp, ids), whole)  # a prompt chunk in the C loop
        assert [o.token_ids for o in tp.generate(PROMPTS, GREEDY)] == tokens
    finally:
        tp.close()
    tp = engine(pair, tensor_parallel_size=2, tensor_parallel_exact=False)
    try:
        comm = tp.target.group.comm
        before = comm.num_all_reduces
        got = prompt_logits(tp, ids[:8])
        assert comm.num_all_reduces - before == 2 * 2 + 1  # o_proj and down per layer, the LM head
        # the ranks' fp32 parts summed in another order than one chain: bf16 roundings may differ
        assert (got - reference).abs().max().item() < 0.05 * reference.abs().max().item()
        assert (got.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.8
    finally:
        tp.close()
