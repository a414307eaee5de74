import pytest

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.testing import tiny_hf_model, tiny_pair

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.fixture(scope="session")
def pair():
    return tiny_pair("llama")


@pytest.fixture(scope="session")
def hf_target():
    return tiny_hf_model("llama")


def make_engine(target, draft=None, **overrides) -> Engine:
    # Fixed k: these tests check what a given k does; tests/engine/test_adaptive.py covers adaptive k.
    kwargs = dict(dtype="float32", num_blocks=64, block_size=4, proposer="draft" if draft is not None else "none",
                  adaptive_k=False)
    kwargs.update(overrides)
    return Engine.from_models(EngineConfig(**kwargs), target, draft)


