"""`specdec chat` driven by scripted input over a tiny engine: history across turns, the prefix
cache serving earlier turns, /reset, /exit, Ctrl-C during an answer, and the statistics line."""

from __future__ import annotations

import io
import os
import re
import signal

import pytest
from rich.console import Console

from specdec.api.chat_cmd import INTERRUPTED, PROMPT, ChatSession, chat_loop
from specdec.api.cli import build_parser
from specdec.api.generate_cmd import stats_line
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.sampling_params import SamplingParams
from specdec.target.tokenizer import apply_chat_template, encode_chat
from specdec.verify import AcceptanceStats

# Greedy, and never an early EOS: every answer has text for the next turn to carry.
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CACHED = re.compile(r"cached (\d+)/(\d+) prompt tokens")


@pytest.fixture()
def engine(tiny_parts) -> Engine:
    target, draft, tokenizer = tiny_parts
    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer="draft")
    return Engine.from_models(config, target, draft, tokenizer)


class RecordingSession(ChatSession):
    """Keeps every Turn, and the blocks both pools held right after it, for the assertions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.turns = []
        self.used_after = []

    def ask(self, *args, **kwargs):
        turn = super().ask(*args, **kwargs)
        self.turns.append(turn)
        self.used_after.append({name: pool["used"] for name, pool in self.engine.kv_usage().items()})
        return turn


class Script:
    """`input()` stand-in: returns the lines in order, then raises EOFError (Ctrl-D); an exception
    instance in the list is raised instead of read."""

    def __init__(self, *lines) -> None:
        self.lines, self.prompts = list(lines), []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line


def consoles() -> tuple[Console, Console]:
    out = Console(file=io.StringIO(), force_terminal=False, highlight=False, soft_wrap=True)
    err = Console(file=io.StringIO(), force_terminal=False, highlight=False, width=300)
    return out, err


def run_chat(engine: Engine, *lines, system: str | None = None, **kwargs):
    session = RecordingSession(engine, PARAMS, system)
    out, err = consoles()
    read = Script(*lines)
    chat_loop(session, read, out, err, **kwargs)
    return session, read, out.file.getvalue(), err.file.getvalue()


def test_second_turn_resends_the_first_answer_from_the_cache(engine):
    session, read, out, err = run_chat(engine, "Write quicksort", "Now in one line", "/exit")
    first, second = session.turns
    assert first.text and first.finish_reason == "length"
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == first.text
    prompt = engine.tokenizer.decode(second.prompt_ids)
    assert "Write quicksort" in prompt and first.text in prompt and "Now in one line" in prompt
    # The first turn's prompt ids open the second's (ChatML renders old turns unchanged), and its
    # full blocks come from the prefix cache; the first turn found nothing cached.
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    assert first.num_cached_tokens == 0
    block = engine.target.block_size
    assert second.num_cached_tokens >= len(first.prompt_ids) // block * block > 0
    # Each answer is followed by its statistics line, with the cached count of its own prompt.
    counts = [tuple(map(int, m)) for m in CACHED.findall(err)]
    assert counts == [(t.num_cached_tokens, len(t.prompt_ids)) for t in session.turns]
    assert first.text in out and second.text in out
    assert read.prompts == [PROMPT] * 3


def test_reset_drops_the_history_but_keeps_the_system_prompt(engine):
    session, _, _, err = run_chat(engine, "Write quicksort", "/reset", "Hello", system="Be brief.")
    assert "conversation cleared" in err
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    assert session.messages[1]["content"] == "Hello"
    prompt = engine.tokenizer.decode(session.turns[1].prompt_ids)
    assert "Be brief." in prompt and "Write quicksort" not in prompt
    assert session.turns[0].text not in prompt


@pytest.mark.parametrize("leave", ["/exit", "/quit", EOFError(), KeyboardInterrupt()])
def test_exit_eof_and_ctrl_c_at_the_prompt_leave(engine, leave):
    session, read, _, _ = run_chat(engine, leave, "never read")
    assert session.turns == [] and session.messages == []
    assert read.lines == ["never read"]


def test_blank_lines_and_unknown_commands_are_not_sent(engine):
    session, _, _, err = run_chat(engine, "", "   ", "/nope", "/help", "/exit")
    assert session.turns == []
    assert "unknown command /nope" in err and "/reset" in err


class StepInterrupter:
    """Wraps engine.step: on call number `at`, Ctrl-C arrives, either as a SIGINT (what a
    terminal sends) or as a KeyboardInterrupt raised inside the step."""

    def __init__(self, engine: Engine, at: int, how: str) -> None:
        self.engine, self.step, self.at, self.how, self.calls = engine, engine.step, at, how, 0
        engine.step = self

    def __call__(self):
        self.calls += 1
        if self.calls == self.at:
            if self.how == "raise":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)  # the chat's handler only raises a flag
        return self.step()


@pytest.mark.parametrize("how", ["sigint", "raise"])
def test_ctrl_c_while_streaming_aborts_the_answer_and_the_chat_goes_on(engine, how):
    previous = signal.getsignal(signal.SIGINT)
    StepInterrupter(engine, 3, how)
    session, _, out, err = run_chat(engine, "Write quicksort", "Hello again", "/exit")
    assert signal.getsignal(signal.SIGINT) is previous  # the chat put the handler back

    stopped, after = session.turns
    assert stopped.finish_reason == INTERRUPTED and stopped.interrupted
    assert 0 < stopped.num_tokens < PARAMS.max_tokens and stopped.text
    assert session.used_after[0] == {"target": 0, "draft": 0}  # aborted: no blocks held
    assert "interrupted: the partial answer stays in the conversation" in err
    # The chat went on: the next turn ran to its end, with the partial answer in its history.
    assert after.finish_reason == "length" and not after.interrupted
    assert stopped.text in engine.tokenizer.decode(after.prompt_ids)
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert session.messages[1]["content"] == stopped.text
    assert engine.target.pool.num_used == 0 and not engine.has_unfinished()
    assert len(CACHED.findall(err)) == 2  # the interrupted answer has its statistics line too


def test_ctrl_c_before_the_first_token_drops_the_question(engine):
    StepInterrupter(engine, 1, "raise")  # the prefill step itself
    session, _, _, err = run_chat(engine, "Write quicksort", "Hello")
    stopped, after = session.turns
    assert stopped.interrupted and stopped.text == "" and stopped.num_tokens == 0
    assert session.used_after[0]["target"] == 0
    assert "the question is dropped" in err
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["Hello"]
    assert "Write quicksort" not in engine.tokenizer.decode(after.prompt_ids)


def test_a_conversation_longer_than_the_context_is_refused_and_the_chat_goes_on(tiny_parts):
    target, draft, tokenizer = tiny_parts
    config = EngineConfig(dtype="float32", num_blocks=64, block_size=4, proposer="draft", max_model_len=48)
    engine = Engine.from_models(config, target, draft, tokenizer)
    session, _, _, err = run_chat(engine, "Write quicksort " * 20, "Hi", "/exit")
    assert "error: the prompt has" in err and "/reset" in err
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["Hi"]
    assert len(session.turns) == 1 and engine.target.pool.num_used == 0


def test_live_terminal_output_and_colors(engine):
    session = RecordingSession(engine, PARAMS)
    out = Console(file=io.StringIO(), force_terminal=True, highlight=False, soft_wrap=True)
    err = Console(file=io.StringIO(), force_terminal=True, highlight=False, width=300)
    chat_loop(session, Script("Write quicksort"), out, err, colors=True)
    assert len(session.turns) == 1
    assert "\x1b[" in out.file.getvalue()  # the live region and the origin colors
    assert CACHED.search(err.file.getvalue())


def test_quiet_stats_prints_no_statistics(engine):
    _, _, _, err = run_chat(engine, "Write quicksort", stats=False)
    assert not CACHED.search(err)


def test_encode_chat_matches_the_single_prompt_and_rejects_bad_messages(tiny_parts):
    tokenizer = tiny_parts[2]
    assert encode_chat(tokenizer, [{"role": "user", "content": "hi"}]) == apply_chat_template(tokenizer, "hi")
    with pytest.raises(ValueError, match="no messages"):
        encode_chat(tokenizer, [])
    with pytest.raises(ValueError, match="message 1"):
        encode_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="message 0"):
        encode_chat(tokenizer, ["hi"])


def test_encode_chat_needs_a_chat_template(tiny_parts):
    import copy

    tokenizer = copy.deepcopy(tiny_parts[2])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_chat(tokenizer, [{"role": "user", "content": "hi"}])


def test_generate_stats_line_shows_cached_tokens_only_when_some_were():
    acceptance = AcceptanceStats()
    acceptance.update(4, 2)
    plain = stats_line(10, 2.0, 0.5, acceptance, num_cached=0, num_prompt_tokens=20)
    assert "cached" not in plain and "acceptance 50.0%" in plain and "5.00 tok/s" in plain
    assert stats_line(10, 2.0, 0.5, acceptance, 16, 20).endswith(" · cached 16/20 prompt tokens")
    assert "cached 0/20 prompt tokens" in stats_line(10, 2.0, 0.5, acceptance, 0, 20, always_show_cached=True)


def test_parser_has_chat_with_system_and_engine_flags(capsys):
    from specdec.api import chat_cmd

    args = build_parser().parse_args(["chat", "--system", "Be brief.", "--no-prefix-caching", "-k", "3",
                                      "--temperature", "0"])
    assert args.func is chat_cmd.run and args.system == "Be brief."
    assert args.prefix_caching is False and args.num_speculative_tokens == 3 and args.temperature == 0
    assert build_parser().parse_args(["chat"]).system is None
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["chat", "--help"])
    assert exit_info.value.code == 0
    assert "--system TEXT" in capsys.readouterr().out


def test_a_gpt_oss_answer_shows_its_reasoning_and_keeps_its_final_message():
    """harmony: the markers are read, not shown (reasoning, a blank line, the answer), and the
    history keeps the final message only, as gpt-oss's template writes earlier answers."""
    from dataclasses import replace

    from specdec.sampling_params import StructuredSpec
    from specdec.testing import noisy_twin, tiny_pair, tiny_tokenizer

    from .test_tool_formats import HARMONY, HARMONY_TOKENS

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = HARMONY
    target, _ = tiny_pair("qwen2", 2, vocab_size=len(tokenizer), eos_token_id=2, bos_token_id=None)
    engine = Engine.from_models(EngineConfig(dtype="float32", num_blocks=128, block_size=4, proposer="draft"),
                                target, noisy_twin(target), tokenizer)
    grammar = ('start: <|channel|> "analysis" <|message|> "Thinking." <|end|> <|start|> "assistant" '
               '<|channel|> "final" <|message|> /[a-z ]{3,12}/')
    params = replace(PARAMS, ignore_eos=False, max_tokens=40, structured=StructuredSpec.lark(grammar))
    session = RecordingSession(engine, params)
    out, err = consoles()
    chat_loop(session, Script("Hi"), out, err)
    (turn,) = session.turns
    final = session.messages[-1]["content"]
    assert turn.text.startswith("<|channel|>analysis<|message|>Thinking.<|end|>") and turn.text.endswith(final)
    assert 3 <= len(final) and "<|" not in final
    assert out.file.getvalue().startswith(f"Thinking.\n\n{final}")
