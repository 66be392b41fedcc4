"""Structured outputs, forced tool calls and logit_bias through the server (grammar/grammar.h's xgrammar
masks, applied in the CPU sampler): OpenAI's response_format, vLLM's structured_outputs and guided_*
fields, tool_choice "required" and a named function. The demo model writes Python, so each test picks
a constraint whose valid outputs end quickly and checks the text against it."""
import json
import re

import pytest
import requests

from relay_server import MODEL, server_fixture

TOOLS = [{"type": "function", "function": {
    "name": "set_mode", "description": "Set the mode.",
    "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "safe"]}},
                   "required": ["mode"]}}},
    {"type": "function", "function": {
        "name": "stop_all", "parameters": {"type": "object", "properties": {}}}}]


server = server_fixture()


def chat(server, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 60,
            "temperature": 0, **fields}
    return requests.post(server.base + "/v1/chat/completions", json=body, timeout=120)


def completion(server, **fields):
    body = {"model": MODEL, "prompt": "def answer():\n    return ", "max_tokens": 60, "temperature": 0, **fields}
    return requests.post(server.base + "/v1/completions", json=body, timeout=120)


def test_choice_regex_and_grammar_constrain_the_text(server):
    for r, valid in [
            (chat(server, structured_outputs={"choice": ["yes", "no", "not sure"]}), lambda t: t in ("yes", "no", "not sure")),
            (chat(server, guided_choice=["alpha", "beta"]), lambda t: t in ("alpha", "beta")),
            (completion(server, structured_outputs={"regex": "[0-9]{3}-[a-c]"}),
             lambda t: re.fullmatch("[0-9]{3}-[a-c]", t)),
            (completion(server, guided_grammar='root ::= "x" ("y" | "z") "!"'), lambda t: t in ("xy!", "xz!"))]:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and valid(text), text


def test_json_schema_output_is_valid_json(server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "count": {"type": "integer", "enum": [1, 2, 3]}},
              "required": ["answer", "count"], "additionalProperties": False}
    # (The demo model likes whitespace: it may use the grammar's 64 characters in each place.)
    r = chat(server, max_tokens=400,
             response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"answer", "count"} and value["answer"] in ("yes", "no") and value["count"] in (1, 2, 3)
    # The same through vLLM's fields, schema given as a string, and streamed: the same text.
    for fields in ({"structured_outputs": {"json": json.dumps(schema)}}, {"guided_json": schema}):
        again = chat(server, max_tokens=400, **fields)
        assert again.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    streamed = requests.post(server.base + "/v1/chat/completions", stream=True, timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 400, "temperature": 0,
        "stream": True, "guided_json": schema})
    text = "".join(json.loads(l[6:])["choices"][0]["delta"].get("content", "") for l in streamed.iter_lines()
                   if l.startswith(b"data: {") and json.loads(l[6:])["choices"])
    assert text == choice["message"]["content"]


def test_json_object_starts_a_json_value(server):
    r = chat(server, response_format={"type": "json_object"}, max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].lstrip()[:1] in ("{", "[")


def test_tool_choice_required_and_named_force_a_call(server):
    # Parallel calls allowed: the demo model keeps calling until max_tokens, every call well formed.
    r = chat(server, tools=TOOLS, tool_choice="required")
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"] and (message["content"] or "<tool_call>").startswith("<tool_call>"), message
    # One call: it ends with the call.
    r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 1 and all(c["function"]["name"] in ("set_mode", "stop_all") for c in calls)
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] == "set_mode":
            assert args["mode"] in ("fast", "safe")
    r = chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_mode"}})
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["set_mode"]
    assert json.loads(calls[0]["function"]["arguments"])["mode"] in ("fast", "safe")


def test_logit_bias(server):
    x = requests.post(server.base + "/tokenize", json={"prompt": "x"}, timeout=10).json()["tokens"][0]
    r = completion(server, max_tokens=4, logit_bias={str(x): 100})
    assert r.json()["choices"][0]["text"] == "xxxx"
    first = completion(server, max_tokens=1).json()["choices"][0]["text"]
    first_id = requests.post(server.base + "/tokenize", json={"prompt": first}, timeout=10).json()["tokens"][0]
    banned = completion(server, max_tokens=1, logit_bias={str(first_id): -100}).json()["choices"][0]["text"]
    assert banned != first


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_constraints_are_400s_naming_the_field(server, fields, param):
    r = chat(server, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_the_openai_client(server):
    client = server.client()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer."}], max_tokens=400, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer."}], max_tokens=60, temperature=0, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_mode"}})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "set_mode"
    r = client.completions.create(model=MODEL, prompt="def f(", max_tokens=3, temperature=0,
                                  extra_body={"guided_choice": ["x)", "y)"]})
    assert r.choices[0].text in ("x)", "y)")
