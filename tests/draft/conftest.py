from dataclasses import dataclass

import pytest
import torch

from specdec.cache import BlockTable
from specdec.draft import SamplingTensors, SeqPlan, StepPlan
from specdec.target.runner import ModelRunner, Window
from specdec.testing import tiny_pair


@dataclass
class Seq:
    """The view of a sequence a proposer reads (`DraftSequence`)."""

    token_ids: list[int]
    draft_table: BlockTable | None = None


@pytest.fixture(scope="session")
def draft_model():
    return tiny_pair("llama")[1]


@pytest.fixture
def runner(draft_model):
    return ModelRunner.build(draft_model, block_size=4, num_blocks=64)


def seq_with_cache(runner, token_ids: list[int], cached: int, slots: int = 64) -> Seq:
    """A sequence whose draft cache holds its first `cached` tokens."""
    table = runner.new_table()
    assert table.ensure_slots(slots)
    if cached:
        runner.forward([Window(table, token_ids[:cached], 0)])
    return Seq(list(token_ids), table)


def plan_of(rows: list[SeqPlan], fills: list[SeqPlan] = ()) -> StepPlan:
    return StepPlan(list(rows) + list(fills), list(rows))


def greedy(batch: int) -> SamplingTensors:
    return SamplingTensors(
        torch.zeros(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch), [None] * batch
    )


class CountingForward:
    """Wraps a runner's forward and records the rows of each call."""

    def __init__(self, runner) -> None:
        self.forward, self.calls = runner.forward, []
        runner.forward = self

    def __call__(self, windows):
        self.calls.append([len(w.token_ids) for w in windows])
        return self.forward(windows)
