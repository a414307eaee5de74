"""The real default pair (Qwen2.5-Coder 1.5B / 0.5B GGUF): parity with transformers and greedy
equality of speculative decoding. Skipped with the install command when the `models` extra is absent.
"""

import gc

import pytest
import torch

from specdec.target import default_pair

pytestmark = [pytest.mark.real_pair, pytest.mark.slow]

PROMPT = "Write a quicksort in Python."
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_and_reference():
    if not default_pair.models_installed():
        pytest.skip(f"default model pair not installed; install with: {default_pair.INSTALL_COMMAND}")
    from transformers import AutoModelForCausalLM

    from specdec.target.model_files import resolve_model, transformers_weights
    from specdec.target.tokenizer import apply_chat_template, load_tokenizer

    folder = resolve_model("default-target", progress=False)
    ids = apply_chat_template(load_tokenizer(folder), PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **transformers_weights(folder)).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_TOKENS, do_sample=False)
    reference = out[0, len(ids):].tolist()
    del hf, out
    gc.collect()
    return ids, reference


def _engine(**overrides):
    from specdec import Engine, EngineConfig

    return Engine(EngineConfig(dtype="float32", kv_cache_memory_gib=0.5, **overrides))


def test_target_greedy_equals_transformers_and_speculative_equals_target(prompt_and_reference):
    from specdec import SamplingParams

    ids, reference = prompt_and_reference
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    plain = _engine(proposer="none").generate([ids], params)[0].token_ids
    gc.collect()
    assert plain == reference[: len(plain)] and len(plain) >= min(NUM_TOKENS, len(reference))
    engine = _engine(num_speculative_tokens=4)
    spec = engine.generate([ids], params)[0]
    assert spec.token_ids == plain
    assert spec.stats.num_draft_tokens > 0 and spec.stats.acceptance_rate > 0.3
