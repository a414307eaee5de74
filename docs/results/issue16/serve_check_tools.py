"""Issue 16's done-when, through a running `specdec serve` with the official openai client:

1. 20 prompts, each with its own JSON schema, as `response_format` json_schema, streamed and not:
   every answer validated with jsonschema (x/20 each way);
2. two tools (get_weather, search_code) with `tool_choice="auto"`: the call must be well formed and
   its arguments validate (streamed and not; the streamed deltas must reassemble to the same call);
3. the assistant's call and a `tool` message sent back: the request is accepted and the model goes
   on (with `tool_choice="auto"` and, the tools out of the prompt, `"none"`).

    specdec serve --port 8765 &
    python docs/results/issue16/serve_check_tools.py --url http://127.0.0.1:8765/v1
"""

from __future__ import annotations

import argparse
import json

import jsonschema
import openai

S, I, B = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "boolean"}


def obj(required: bool = True, **props) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required else [],
            "additionalProperties": False}


def arr(items: dict, most: int = 5) -> dict:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


WORKLOAD = [
    ("Describe Guido van Rossum as JSON.", obj(name=S, born=I, languages=arr(S))),
    ("Describe the Python function sorted() as JSON.", obj(name=S, parameters=arr(S), returns=S, pure=B)),
    ("Is 97 a prime number? Answer as JSON.", obj(number=I, is_prime=B)),
    ("Give the HTTP status code for 'Not Found' as JSON.", obj(code={"type": "integer", "minimum": 100,
                                                                     "maximum": 599}, phrase=S)),
    ("Classify the sentiment of 'I love this library!' as JSON.",
     obj(sentiment={"enum": ["positive", "negative", "neutral"]}, confidence={"type": "number", "minimum": 0,
                                                                              "maximum": 1})),
    ("List three sorting algorithms with their average time complexity as JSON.",
     obj(algorithms=arr(obj(name=S, complexity=S), 3))),
    ("Give the RGB values of pure orange as JSON.", obj(r={"type": "integer", "minimum": 0, "maximum": 255},
                                                       g={"type": "integer", "minimum": 0, "maximum": 255},
                                                       b={"type": "integer", "minimum": 0, "maximum": 255})),
    ("Describe a git commit that fixes a typo in README.md as JSON.",
     obj(message=S, files=arr(S, 3), insertions=I, deletions=I)),
    ("Convert 'Hello World' to snake_case and camelCase, as JSON.", obj(snake_case=S, camel_case=S)),
    ("Give the capital and population (millions) of France as JSON.",
     obj(country=S, capital=S, population_millions={"type": "number"})),
    ("Describe a Dockerfile for a Python 3.11 web app as JSON.",
     obj(base_image=S, exposed_port=I, commands=arr(S, 4))),
    ("What day of the week was 2000-01-01? Answer as JSON.",
     obj(date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
         weekday={"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]})),
    ("Give two unit tests for a function add(a, b) as JSON.",
     obj(tests=arr(obj(a=I, b=I, expected=I), 2))),
    ("Describe the SQL query that counts users per country as JSON.",
     obj(query={"type": "string", "maxLength": 120}, tables=arr(S, 2), uses_group_by=B)),
    ("Rate the difficulty of learning Rust from 1 to 10 with a reason, as JSON.",
     obj(language=S, difficulty={"type": "integer", "minimum": 1, "maximum": 10}, reason={"type": "string",
                                                                                         "maxLength": 80})),
    ("Describe a REST endpoint that deletes a user as JSON.",
     obj(method={"enum": ["GET", "POST", "PUT", "PATCH", "DELETE"]}, path=S, auth_required=B)),
    ("Give the semantic version that follows 1.4.2 after a bug fix, as JSON.",
     obj(previous=S, next=S, bump={"enum": ["major", "minor", "patch"]})),
    ("Name a data structure with O(1) average lookup and one with O(log n), as JSON.",
     {"type": "array", "items": obj(structure=S, lookup=S), "minItems": 2, "maxItems": 2}),
    ("Describe the file config.yaml in a project, optional owner, as JSON.",
     obj(required=False, path=S, format={"enum": ["yaml", "json", "toml"]}, owner={"anyOf": [S, {"type": "null"}]})),
    ("Summarize the tradeoffs of speculative decoding as JSON.",
     obj(pros=arr({"type": "string", "maxLength": 60}, 3), cons=arr({"type": "string", "maxLength": 60}, 3))),
]

WEATHER = obj(city=S, unit={"enum": ["celsius", "fahrenheit"]})
SEARCH = {"type": "object", "properties": {"query": S, "max_results": {"type": "integer", "minimum": 1,
                                                                         "maximum": 50}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search_code", "description": "Search the code base",
                                      "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search_code": SEARCH}


def ask(client, stream: bool, **kwargs) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason); streamed: reassembled from the deltas."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index == len(calls):
                calls.append([call.id, call.function.name, call.function.arguments or ""])
            else:
                calls[call.index][2] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [tuple(c) for c in calls], finish


def check_schemas(client, model: str, max_tokens: int) -> None:
    for stream in (False, True):
        valid = 0
        print(f"\n## response_format json_schema, stream={stream}\n")
        for i, (prompt, schema) in enumerate(WORKLOAD):
            fmt = {"type": "json_schema", "json_schema": {"name": f"answer_{i}", "schema": schema, "strict": True}}
            text, _, finish = ask(client, stream, model=model, messages=[{"role": "user", "content": prompt}],
                                  max_tokens=max_tokens, temperature=0, response_format=fmt)
            try:
                jsonschema.validate(json.loads(text), schema)
                valid, verdict = valid + 1, "valid"
            except (json.JSONDecodeError, jsonschema.ValidationError) as error:
                verdict = f"INVALID ({type(error).__name__})"
            print(f"{i + 1:2d}. finish={finish} {verdict}: {text}", flush=True)
        print(f"\n{valid}/{len(WORKLOAD)} answers validate (stream={stream})", flush=True)


def check_tools(client, model: str, max_tokens: int) -> None:
    print("\n## two tools, tool_choice=auto\n")
    messages = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
    answers = {}
    for stream in (False, True):
        answers[stream] = content, calls, finish = ask(client, stream, model=model, messages=messages, tools=TOOLS,
                                                       tool_choice="auto", max_tokens=max_tokens, temperature=0)
        print(f"stream={stream} finish={finish} content={content!r} calls={calls}")
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            print(f"  {name} arguments validate: {arguments}")
    same = [(c[1], c[2]) for c in answers[False][1]] == [(c[1], c[2]) for c in answers[True][1]]
    print(f"streamed deltas reassemble to the non-streamed call: {same}")
    search = [{"role": "user", "content": "Find where quicksort is implemented in our code base; 5 results."}]
    content, calls, finish = ask(client, False, model=model, messages=search, tools=TOOLS, tool_choice="auto",
                                 max_tokens=max_tokens, temperature=0)
    print(f"\nsecond prompt: finish={finish} content={content!r} calls={calls}")
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        print(f"  {name} arguments validate: {arguments}")

    print("\n## the conversation continues after a tool message\n")
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                         temperature=0)
    message = out.choices[0].message
    call = message.tool_calls[0]
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny"})}]
    print("sent back:", json.dumps(messages[1:], indent=1))
    for choice in ("auto", "none"):  # none: the tools leave the prompt; the call and its result stay
        final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                               max_tokens=max_tokens, temperature=0)
        print(f"answer (tool_choice={choice}): finish={final.choices[0].finish_reason} "
              f"tool_calls={final.choices[0].message.tool_calls} content={final.choices[0].message.content!r}")

    print("\n## tool_choice required / named\n")
    for choice in ("required", {"type": "function", "function": {"name": "search_code"}}):
        content, calls, finish = ask(client, False, model=model, messages=search, tools=TOOLS, tool_choice=choice,
                                     parallel_tool_calls=False, max_tokens=max_tokens, temperature=0)
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        print(f"tool_choice={json.dumps(choice)}: finish={finish} content={content!r} calls={calls} (validate)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8765/v1")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--skip-schemas", action="store_true")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused", timeout=900, max_retries=0)
    model = client.models.list().data[0].id
    if not args.skip_schemas:
        check_schemas(client, model, args.max_tokens)
    check_tools(client, model, args.max_tokens)


if __name__ == "__main__":
    main()
