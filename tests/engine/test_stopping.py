"""StopChecker: stable text deltas, stop strings that never leak into the stream, and the stop
rules a request ends on (EOS without being emitted, stop token ids, max_tokens)."""

import pytest

from specdec.sampling_params import SamplingParams
from specdec.sequence import Sequence
from specdec.step.stopping import StopChecker, append_until_stop
from specdec.testing import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def push_text(checker: StopChecker, tok, text: str) -> tuple[list[str], str | None]:
    """Push `text` one token at a time; the deltas until a stop, and the stop."""
    deltas = []
    for token in tok.encode(text, add_special_tokens=False):
        delta, hit = checker.push([token])
        deltas.append(delta)
        if hit:
            return deltas, hit
    return deltas, None


def test_text_arrives_whole_and_in_order(tok):
    checker = StopChecker(tok, [], SamplingParams())
    deltas, hit = push_text(checker, tok, "def quicksort(xs):")
    assert hit is None and "".join(deltas) == "def quicksort(xs):" == checker.text


def test_a_stop_string_across_tokens_never_leaks(tok):
    checker = StopChecker(tok, [], SamplingParams(stop=["\n\n"]))
    deltas, hit = push_text(checker, tok, "print(i)\n\nmore")
    assert hit == "stop" and "".join(deltas) == "print(i)" == checker.text
    assert all("\n" not in d for d in deltas)


def test_a_held_back_prefix_is_released_when_it_is_no_stop(tok):
    checker = StopChecker(tok, [], SamplingParams(stop=["fox jumps"]))
    deltas, hit = push_text(checker, tok, "the quick brown fox")
    assert hit is None and "".join(deltas) == "the quick brown "  # "fox" may start the stop
    tail, hit = checker.push([], final=True)
    assert hit is None and tail == "fox" and checker.text == "the quick brown fox"


def test_without_a_tokenizer_there_is_no_text():
    checker = StopChecker(None, [1, 2], SamplingParams(stop=["x"]))
    assert checker.push([5, 6]) == ("", None) and checker.text == ""


def make_seq(params: SamplingParams) -> Sequence:
    seq = Sequence("r", [1, 2, 3], params, 0, 0)
    seq.detokenizer = StopChecker(None, seq.token_ids, params)
    return seq


def test_eos_ends_the_request_without_being_emitted():
    seq = make_seq(SamplingParams(max_tokens=10))
    emitted, _, reason = append_until_stop(seq, [7, 2, 9], {2}, 100)
    assert emitted == [7] and reason == "stop" and seq.token_ids == [1, 2, 3, 7, 2]
    ignoring = make_seq(SamplingParams(max_tokens=10, ignore_eos=True))
    assert append_until_stop(ignoring, [7, 2, 9], {2}, 100) == ([7, 2, 9], ["", "", ""], None)


def test_stop_token_ids_are_emitted_and_end_the_request():
    seq = make_seq(SamplingParams(max_tokens=10, stop_token_ids=[9]))
    emitted, _, reason = append_until_stop(seq, [7, 9, 8], {2}, 100)
    assert emitted == [7, 9] and reason == "stop"


def test_max_tokens_and_the_context_end_with_length():
    seq = make_seq(SamplingParams(max_tokens=2))
    assert append_until_stop(seq, [7, 8, 9], {2}, 100)[0::2] == ([7, 8], "length")
    seq = make_seq(SamplingParams(max_tokens=10))
    assert append_until_stop(seq, [7, 8, 9], {2}, 5)[0::2] == ([7, 8], "length")
