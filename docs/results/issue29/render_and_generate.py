import json
from specdec.target.model_files import resolve_model
from specdec.target.tokenizer import load_tokenizer
from specdec.api.messages import ChatMessage
tok = load_tokenizer(resolve_model("default-target"))
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
msgs = [{"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 19, \"sky\": \"clear\"}"}]
ours = [ChatMessage(**m).as_template_dict() for m in msgs]
a = tok.apply_chat_template(ours, tools=tools, add_generation_prompt=True, tokenize=False)
# the template's own rendering of OpenAI messages, arguments parsed as templates expect
direct = json.loads(json.dumps(msgs)); direct[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}; direct[1]["content"] = ""
b = tok.apply_chat_template(direct, tools=tools, add_generation_prompt=True, tokenize=False)
print("EQUAL" if a == b else "DIFFER"); print(a[-600:])
from specdec import Engine, EngineConfig, SamplingParams
e = Engine(EngineConfig(dtype="bfloat16", kv_cache_memory_gib=0.25))
ids = tok.apply_chat_template(ours, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
out = e.generate([list(ids)], SamplingParams(temperature=0, max_tokens=60))[0]
print("UNCONSTRAINED GREEDY:", repr(out.text))
