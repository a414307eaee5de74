"""The baseline decoders' timing: one chunk per streamer push, llama.cpp stops at max_tokens."""

import itertools

import torch

from specdec.eval.metrics import RequestTrace
from specdec.eval.systems import LlamaCppDecoder, TimingStreamer


def test_timing_streamer_skips_the_prompt_and_counts_tokens_per_push():
    trace = RequestTrace(0.0)
    streamer = TimingStreamer(trace)
    streamer.put(torch.tensor([[1, 2, 3, 4]]))  # generate() pushes the prompt first
    streamer.put(torch.tensor([7]))
    streamer.put(torch.tensor([[8, 9, 10]]))  # assisted generation pushes accepted runs at once
    streamer.end()
    assert trace.chunk_tokens == [1, 3] and trace.num_output_tokens == 4


class FakeLlama:
    """Stands in for llama_cpp.Llama: `generate` streams token ids forever, as the real one does."""

    def __init__(self) -> None:
        self.resets = 0
        self.calls = []

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens, **sampling):
        self.calls.append((list(tokens), sampling))
        return itertools.count(100)


def test_llama_cpp_decoder_is_greedy_resets_the_cache_and_stops_at_max_tokens():
    llm = FakeLlama()
    trace = LlamaCppDecoder(llm).decode([1, 2, 3], 5)
    assert trace.token_ids == [100, 101, 102, 103, 104] and trace.chunk_tokens == [1] * 5
    assert llm.resets == 1  # the previous run's prompt KV is not reused
    tokens, sampling = llm.calls[0]
    assert tokens == [1, 2, 3] and sampling["temp"] == 0.0 and sampling["repeat_penalty"] == 1.0
