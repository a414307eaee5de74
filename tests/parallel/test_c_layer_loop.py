"""A bf16 target on the C kernels (w4a8 tiles, the C layer loop) split over 2 ranks: the tensor-
parallel ranks' all-reduces run inside `decoder_layers`; pipeline stages are bitwise one process."""

from __future__ import annotations

import pytest
import torch

from specdec import Engine, EngineConfig, SamplingParams
from specdec.target.quant import decoder_stack
from specdec.testing import tiny_hf_model, tiny_tokenizer
from tests.parallel.test_parallel import PROMPTS, prompt_logits

pytestmark = pytest.mark.skipif(decoder_stack.kernel().unavailable_reason() is not None,
                                reason="the C layer loop is unavailable here")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-c")
    tokenizer = tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    paths = []
    for name, layers, seed in (("target", 2, 3), ("draft", 1, 4)):
        model = tiny_hf_model("qwen2", seed, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                              num_hidden_layers=layers, hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.25)  # keep bf16 activations tame over the layers
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)
        paths.append(str(root / name))
    return paths


def engine(pair, **kw) -> Engine:
    return Engine(EngineConfig(target=pair[0], draft=pair[1], dtype="bfloat16", target_quant="w4a8",
                               draft_quant="w4a8", num_blocks=64, **kw))


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_ranks_run_the_c_layer_loop(pair):
    one = engine(pair)
    ids = one.encode(PROMPTS[0])
    reference, tokens = prompt_logits(one, ids[:8]), [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.close()
    pp = engine(pair, pipeline_parallel_size=2)
    try:
        assert pp.target.model._layer_stack is not None
        assert torch.equal(prompt_logits(pp, ids[:8]), reference)  # stages: the same calls, bitwise
        assert [o.token_ids for o in pp.generate(PROMPTS, GREEDY)] == tokens
    finally:
        pp.close()
    tp = engine(pair, tensor_parallel_size=2)
    try:
        stack, comm = tp.target.model._layer_stack, tp.target.group.comm
        assert stack is not None and stack.comm is comm and comm.group is not None
        before = comm.num_all_reduces
        got = prompt_logits(tp, ids[:8])  # 8 rows: the C loop (prefill of more rows runs in Python)
        assert comm.num_all_reduces - before == 2 * 2 + 1  # o_proj and down per layer, the LM head
        # the ranks' fp32 parts summed in another order than one chain: bf16 roundings may differ
        assert (got - reference).abs().max().item() < 0.05 * reference.abs().max().item()
        assert (got.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.8
    finally:
        tp.close()
