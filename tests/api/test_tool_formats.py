"""Tool calls in each family's format, on tiny random models with that family's chat template
(the tool parts of Llama 3.1's and Mistral v0.3's templates, written here as the hub files write
them): the format is picked from the template, a forced call parses and validates whole and
streamed, a named one calls that function, the conversation goes on through the template (whose
own checks, such as Mistral's nine-character call ids, pass), and greedy speculative decoding gives
the target-only answer under the grammar. The parser, fed in any split, agrees with the whole
answer."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest

from specdec.api.harmony import HarmonyParser
from specdec.api.tool_calls import split_tool_calls, tool_call_parser
from specdec.api.tools import template_call_format
from specdec.testing import TINY_CHAT_TEMPLATE, noisy_twin, tiny_pair, tiny_tokenizer

from .conftest import MODEL
from .test_tools import SCHEMAS, TOOLS, tool_engine

LLAMA31 = (
    "{{- bos_token if bos_token else '' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ system_message }}<|eot_id|>"
    "{%- if tools is not none and tools %}{%- set first_user_message = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "Do not use variables.\n\n"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' + (tool_call.arguments | tojson) + '}' }}<|eot_id|>"
    "{%- else %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token if bos_token else '' }}{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and tools and loop.last %}[AVAILABLE_TOOLS] ["
    "{%- for tool in tools %}{{- tool | tojson }}{%- if not loop.last %}, {% endif %}{%- endfor %}]"
    "[/AVAILABLE_TOOLS]{%- endif %}[INST] {{ message['content'] }}[/INST]"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}[TOOL_CALLS] ["
    "{%- for tool_call in message.tool_calls %}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' + (tool_call.function.arguments | tojson)"
    " + ', \"id\": \"' + tool_call.id + '\"}' }}{%- if not loop.last %}, {% endif %}{%- endfor %}]<|im_end|>"
    "{%- elif message['role'] == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message.content|tojson }}, "
    "\"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %}{{ message['content'] }}<|im_end|>{%- endif %}{%- endfor %}"
)
QWEN3_CODER = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{%- for tool in tools %}{%- set tool = tool.function if tool.function is defined else tool %}"
    "{{- '\n<function>\n<name>' + tool.name + '</name>\n<parameters>' }}"
    "{%- for param_name, param_fields in tool.parameters.properties|items %}"
    "{{- '\n<parameter>\n<name>' + param_name + '</name>' }}"
    "{%- if param_fields.type is defined %}{{- '\n<type>' + (param_fields.type | string) + '</type>' }}{%- endif %}"
    "{{- '\n</parameter>' }}{%- endfor %}{{- '\n</parameters>\n</function>' }}{%- endfor %}"
    "{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "{{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}"
    "{%- for args_name, args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\n' }}"
    "{%- set args_value = args_value if args_value is string else args_value | tojson %}"
    "{{- args_value + '\n</parameter>\n' }}{%- endfor %}{{- '</function>\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# gpt-oss's template, its harmony parts: the system message with the reasoning effort and channels,
# the tools as a TypeScript namespace in the developer message, earlier calls (to=functions.f in the
# role's place, after their reasoning, read from `thinking`; `<|call|>`), tool results from
# functions.f, and the answer's `<|start|>assistant`
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for tool in tools %}{%- set tool = tool.function if tool.function is defined else tool %}"
    "{{- '// ' + (tool.description or '') + '\ntype ' + tool.name + ' = (_: {\n' }}"
    "{%- for name, param in (tool.parameters.properties or {})|items %}"
    "{{- name + ': ' + (param.type | default('any') | string) + ',\n' }}{%- endfor %}"
    "{{- '}) => any;\n\n' }}{%- endfor %}} // namespace functions<|end|>{%- endif %}"
    "{%- set ns = namespace(last_call='') %}{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set call = message.tool_calls[0].function %}{%- set ns.last_call = call.name %}"
    "{%- if message.content and message.thinking %}{{- raise_exception('Cannot pass both content and thinking "
    "in an assistant message with tool calls!') }}{%- endif %}"
    "{%- if message.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
    "{%- endif %}{{- '<|start|>assistant to=' }}{{- 'functions.' + call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- call.arguments | tojson }}<|call|>"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content | tojson }}<|end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
TEMPLATES = {"llama3_json": LLAMA31, "mistral": MISTRAL, "qwen3_coder": QWEN3_CODER, "harmony": HARMONY}
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
            *HARMONY_TOKENS]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "search_code"}}


def test_the_template_picks_the_format():
    tokenizer = tiny_tokenizer()
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for expected, template in [("llama3_json", LLAMA31), ("mistral", MISTRAL), ("qwen3_coder", QWEN3_CODER),
                               ("hermes", TINY_CHAT_TEMPLATE), ("harmony", HARMONY),
                               (None, plain)]:
        tokenizer.chat_template = template
        assert template_call_format(tokenizer) == expected


ANSWERS = [  # (format, answer, content, calls)
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', None, [("f", '{"x": 1}')]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"q": "a;b"}}',
     None, [("f", "{}"), ("g", '{"q": "a;b"}')]),
    ("llama3_json", "It is {sunny} today.", "It is {sunny} today.", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": [1, 2]}}, {"name": "g", "arguments": {}}]',
     None, [("f", '{"x": [1, 2]}'), ("g", "{}")]),
    ("mistral", ' [{"name": "f", "arguments": {"x": "]"}}]', None, [("f", '{"x": "]"}')]),  # the tag a special token
    ("mistral", "[1] It is sunny.", "[1] It is sunny.", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=f>\n<parameter=city>\nNew\nYork\n</parameter>\n"
     "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>", "Sure.", [("f", '{"city": "New\\nYork", "n": 3}')]),
    ("qwen3_coder", "<tool_call>\n<function=g>\n</function>\n</tool_call>\n<tool_call>\n<function=f>\n"
     "<parameter=q>\n</parameter>\n</parameter>\n</function>\n</tool_call>", None, [("g", "{}"), ("f", '{"q": "</parameter>"}')]),
    ("harmony", '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.f <|constrain|>json<|message|>{"city": "<|x"}', None, [("f", '{"city": "<|x"}')]),
    ("harmony", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
     "see.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.", "Let me see.It is sunny.", []),
    ("harmony", " to=functions.g<|channel|>commentary json<|message|>{}", None, [("g", "{}")]),  # recipient first
    ("harmony", "It is {sunny} today.", "It is {sunny} today.", []),  # no message opened: the text as it is
]


def _parser(call_format: str):
    return HarmonyParser() if call_format == "harmony" else tool_call_parser(call_format)


@pytest.mark.parametrize("call_format,answer,content,calls", ANSWERS)
def test_streamed_in_any_split_the_calls_are_the_whole_answers(call_format, answer, content, calls):
    whole = split_tool_calls(answer, parser=_parser(call_format))
    assert (whole[0], [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]]) == (content, calls)
    for cut in range(len(answer) + 1):
        parser = _parser(call_format)
        events = parser.feed(answer[:cut]) + parser.feed(answer[cut:]) + parser.finish()
        text = "".join(getattr(e, "text", "") for e in events if type(e).__name__ == "ContentDelta")
        args = [""] * len(calls)  # harmony streams a call's arguments in pieces, the others whole
        for e in events:
            if type(e).__name__ == "ArgumentsDelta":
                args[e.index] += e.text
        assert (text or None, args) == (content, [a for _, a in calls]), cut


def test_a_call_cut_off_is_neither_content_nor_a_call():
    assert split_tool_calls('{"name": "f", "parameters": {"x": ', "llama3_json") == (None, [])
    assert split_tool_calls('[TOOL_CALLS][{"name": "f", "arg', "mistral") == (None, [])
    assert split_tool_calls("<tool_call>\n<function=f>\n<param", "qwen3_coder") == (None, [])
    cut = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": '
    assert split_tool_calls(cut, parser=HarmonyParser()) == (None, [])


def test_harmony_reasoning_is_its_analysis_channel():
    from specdec.api.answer import AnswerParser, whole_answer

    answer = ("<|channel|>analysis<|message|>The user wants 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4")
    blocks = whole_answer(AnswerParser(False, False, False, harmony=True), answer)
    assert [(b.kind, b.text) for b in blocks] == [("reasoning", "The user wants 2+2."), ("text", "4")]
    cut = whole_answer(AnswerParser(False, False, False, harmony=True), answer[:answer.index(" 2+2")])  # cut off while thinking
    assert [(b.kind, b.text) for b in cut] == [("reasoning", "The user wants")]


def test_qwen3_coder_values_are_read_by_their_schema():
    schemas = {"f": {"properties": {"code": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}}}}
    answer = ("<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n<parameter=n>\n42\n</parameter>\n"
              "<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>")
    _, (call,) = split_tool_calls(answer, "qwen3_coder", schemas)
    assert json.loads(call["function"]["arguments"]) == {"code": "42", "n": 42, "tags": ["a"]}


@pytest.fixture(scope="module")
def family_parts():
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target, _ = tiny_pair("qwen2", 1, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None,
                          max_position_embeddings=2048)
    return target, noisy_twin(target), tokenizer


def _family_server(serve, family_parts, call_format: str):
    target, draft, tokenizer = family_parts
    own = copy.deepcopy(tokenizer)
    own.chat_template = TEMPLATES[call_format]
    with serve(tool_engine(target, draft, own)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield call_format, client


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, serve, family_parts):
    yield from _family_server(serve, family_parts, request.param)


@pytest.fixture(scope="module")
def harmony(serve, family_parts):
    """gpt-oss's format alone: its server."""
    yield from _family_server(serve, family_parts, "harmony")


def _ask(client, stream: bool, **kwargs):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                  parallel_tool_calls=False) | kwargs
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.finish_reason, [(c.id, c.function.name, c.function.arguments)
                                      for c in choice.message.tool_calls or []], choice.message.content
    calls, finish, content = [], None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                calls.append([call.id, call.function.name, ""])
            calls[call.index][2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, [tuple(c) for c in calls], content or None


def test_a_forced_call_parses_and_validates_whole_and_streamed(family):
    call_format, client = family
    for tool_choice, names in (("required", set(SCHEMAS)), (NAMED, {"search_code"})):
        answers = [_ask(client, stream, tool_choice=tool_choice, extra_body={"cache_salt": f"{tool_choice}{stream}"})
                   for stream in (False, True)]
        for finish, calls, content in answers:
            assert (finish, len(calls), content) == ("tool_calls", 1, None), (call_format, calls, content)
            call_id, name, arguments = calls[0]
            assert name in names
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            assert len(call_id) == 9 if call_format == "mistral" else call_id.startswith("call_")
        assert answers[0][1][0][1:] == answers[1][1][0][1:]


def test_speculation_gives_the_target_only_call(family):
    _, client = family
    plain = _ask(client, False, tool_choice="required", extra_body={"num_speculative_tokens": 0, "cache_salt": "a"})
    drafted = _ask(client, False, tool_choice="required", extra_body={"num_speculative_tokens": 4, "cache_salt": "b"})
    assert plain[1][0][1:] == drafted[1][0][1:]


def test_the_conversation_goes_on_through_the_template(family):
    call_format, client = family
    _, ((call_id, name, arguments),), _ = _ask(client, False, tool_choice="required")
    messages = MESSAGES + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_harmony_answers_are_read_by_channel_streamed_and_whole(harmony):
    """gpt-oss: answers under the auto grammar (analysis / commentary messages, then the final answer
    or a call) come back with their markers read, never shown, the same streamed and whole: one pushed
    onto the analysis channel (its "a") is all reasoning, the others' final messages content."""
    _, client = harmony
    a = tiny_tokenizer().convert_tokens_to_ids("a")
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=0, reasoning_effort="low")
    answers = []
    for i, bias in enumerate([{str(a): 30}, {}, {"47": 5}]):
        extra = {"cache_salt": str(i), "logit_bias": bias}
        whole = client.chat.completions.create(extra_body=extra, **kwargs).choices[0]
        message = whole.message
        got = [getattr(message, "reasoning_content", None), message.content,
               [(c.function.name, c.function.arguments) for c in message.tool_calls or []], whole.finish_reason]
        reasoning, content, calls, finish, raw = "", "", [], None, ""
        for chunk in client.chat.completions.create(stream=True, extra_body=extra, **kwargs):
            raw += "".join((chunk.model_extra or {}).get("specdec", {}).get("pieces", []))
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index == len(calls):
                    calls.append([call.function.name, ""])
                calls[call.index][1] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert got == [reasoning or None, content or None, [tuple(c) for c in calls], finish]
        assert raw.startswith("<|channel|>") and "<|" not in reasoning + content, (raw, got)
        answers.append(got)
    assert answers[0][0] and answers[0][1] is None  # all reasoning
    assert any(answer[1] for answer in answers[1:])  # a final message


def test_harmony_calls_through_the_responses_api(harmony):
    """The Responses API reads gpt-oss's call from its messages too (one function_call item)."""
    _, client = harmony
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], tools=tools, tool_choice="required",
                                       max_output_tokens=200, temperature=0)
    (item,) = response.output
    assert item.type == "function_call" and item.name in SCHEMAS, response.output
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


def test_harmony_gets_an_earlier_calls_reasoning_as_thinking(harmony):
    """An assistant call's `reasoning_content` reaches gpt-oss's template as `thinking` (its analysis
    message before the call), so the prompt grows by it."""
    _, client = harmony
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

    def prompt_tokens(**reasoning):
        messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]} | reasoning,
                               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1,
                                                temperature=0)
        return answer.usage.prompt_tokens

    assert prompt_tokens(reasoning_content="Paris is in France.") > prompt_tokens()
    # a preamble (content) beside the call: the template refuses reasoning there, so it is left out
    assert prompt_tokens(content="Let me look.", reasoning_content="x") == prompt_tokens(content="Let me look.")
