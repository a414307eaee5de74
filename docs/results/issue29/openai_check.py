import json
from openai import OpenAI
c = OpenAI(base_url="http://127.0.0.1:8125/v1", api_key="x")
tools = json.load(open("docs/results/issue29/conversation.json"))["tools"]
for stream in (False, True):
    kw = dict(model="default-target", temperature=0, max_tokens=200, tools=tools,
              tool_choice={"type": "function", "function": {"name": "add"}},
              messages=[{"role": "user", "content": "What is 17 plus 25?"}])
    if not stream:
        r = c.chat.completions.create(**kw); ch = r.choices[0]
        print("named, whole:", ch.finish_reason, "content", repr(ch.message.content), [(t.function.name, t.function.arguments) for t in ch.message.tool_calls])
    else:
        calls, content, finish = {}, "", None
        for chunk in c.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            content += d.content or ""
            for t in d.tool_calls or []:
                calls.setdefault(t.index, ["", ""]); calls[t.index][0] += t.function.name or ""; calls[t.index][1] += t.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        print("named, stream:", finish, "content", repr(content or None), list(calls.values()))
kw["max_tokens"] = 60
r = c.chat.completions.create(**kw); ch = r.choices[0]
print("named, max_tokens 60:", ch.finish_reason, repr(ch.message.content), len(ch.message.tool_calls or []))
conv = json.load(open("docs/results/issue29/conversation.json"))
r = c.chat.completions.create(model="default-target", temperature=0, max_tokens=80, tools=tools, messages=conv["messages"])
ch = r.choices[0]
print("after the tool result (auto):", ch.finish_reason, repr(ch.message.content), ch.message.tool_calls)
