"""Qwen3.5's tool calls (the qwen3_coder XML format, issues 25 and 28) end to end: `relay serve` on the demo
weights with Qwen3.5's chat template finds the format from the template, forces a call in it (tool_choice a named
function or "required": the grammar writes <tool_call>\\n<function=NAME>\\n<parameter=P>…</tool_call>, each value as
its schema types it) and returns it as OpenAI tool_calls, typed by the schema, streamed and not; --tool-call-parser
names the format instead, and an unknown name stops the server at start. The demo model writes Python and never
closes a think block, so the requests turn thinking off."""
import json
import shutil
import subprocess

import pytest
import requests

from conftest import ROOT
from relay_server import RelayServer

NAME = "qwen35-demo"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [
    {"type": "function", "function": {
        "name": "set_mode", "description": "Set the mode.",
        "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "safe"]}},
                       "required": ["mode"]}}},
    {"type": "function", "function": {
        "name": "set_level", "description": "Set the level and whether it sticks.",
        "parameters": {"type": "object", "properties": {
            "level": {"type": "integer", "enum": [1, 2, 3]}, "sticky": {"type": "boolean"}},
            "required": ["level", "sticky"]}}},
]


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    """The demo model with Qwen3.5's chat template (chat_template.jinja wins over tokenizer_config.json's)."""
    d = tmp_path_factory.mktemp("qwen35") / NAME
    d.mkdir()
    demo = ROOT / "models" / "relay-demo-moe"
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json"):
        (d / f).symlink_to(demo / f)
    shutil.copy(ROOT / "models" / "templates" / "Qwen3.5-4B.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(scope="module")
def server(relay_bin, qwen35_dir):
    s = RelayServer(relay_bin, "--model", qwen35_dir, "--served-model-name", NAME)
    s.wait_ready()
    yield s
    assert s.stop() == 0


def chat(server, **fields):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Set it up."}], "max_tokens": 300,
            "temperature": 0, "tools": TOOLS, **NO_THINKING, **fields}
    r = requests.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed_calls(server, **fields):
    """The stream's tool calls, each put together from its deltas, and its finish_reason."""
    client = server.client()
    calls, finish = {}, None
    for chunk in client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Set it up."}], max_tokens=300, temperature=0,
            tools=TOOLS, stream=True, extra_body=NO_THINKING, **fields):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_the_format_is_found_from_the_template(server):
    assert "tool calls in the qwen3_coder format (the chat template's)" in server.log_text()


def test_a_named_function_is_forced_and_parsed(server):
    choice = chat(server, tool_choice={"type": "function", "function": {"name": "set_level"}})
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None, message
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "set_level"
    args = json.loads(call["function"]["arguments"])
    # Typed by the schema: an integer and a boolean, not the text of the XML.
    assert set(args) == {"level", "sticky"} and args["level"] in (1, 2, 3) and isinstance(args["sticky"], bool)

    calls, finish = streamed_calls(server, tool_choice={"type": "function", "function": {"name": "set_level"}})
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("set_level", call["function"]["arguments"])]
    assert calls[0]["id"].startswith("call_")


def test_required_forces_a_call_to_one_of_the_tools(server):
    choice = chat(server, tool_choice="required", parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "set_mode":
        assert args == {"mode": args["mode"]} and args["mode"] in ("fast", "safe")
    else:
        assert call["function"]["name"] == "set_level" and args["level"] in (1, 2, 3)

    calls, finish = streamed_calls(server, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call["function"]["name"], call["function"]["arguments"])]


def test_a_conversation_with_qwen3_coder_calls_renders(server):
    # The calls come back as the template renders them in the next turn's prompt.
    choice = chat(server, tool_choice={"type": "function", "function": {"name": "set_mode"}})
    [call] = choice["message"]["tool_calls"]
    follow = chat(server, max_tokens=4, messages=[
        {"role": "user", "content": "Set it up."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "done"}])
    assert follow["finish_reason"] in ("stop", "length", "tool_calls")


def test_the_parser_flag_overrides_the_template(relay_bin, qwen35_dir):
    s = RelayServer(relay_bin, "--model", qwen35_dir, "--served-model-name", NAME, "--tool-call-parser", "hermes")
    s.wait_ready()
    try:
        assert "tool calls in the hermes format (--tool-call-parser)" in s.log_text()
        choice = chat(s, tool_choice={"type": "function", "function": {"name": "set_mode"}})
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "set_mode"
        assert json.loads(call["function"]["arguments"])["mode"] in ("fast", "safe")
    finally:
        assert s.stop() == 0


def test_an_unknown_parser_is_refused_at_start(relay_bin, qwen35_dir):
    r = subprocess.run([str(relay_bin), "serve", "--model", str(qwen35_dir), "--tool-call-parser", "qwen3_xml"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--tool-call-parser" in r.stderr and "qwen3_xml" in r.stderr, r.stderr


def test_ngram_drafts_leave_the_tool_calls_unchanged(relay_bin, qwen35_dir, server):
    """vLLM users saw n-gram speculation corrupt qwen3_coder tool calls while MTP did not (vllm#56077).
    Here drafts are verified against the target and walked through the request's grammar, so a server
    drafting with n-gram answers every tool-call request as the server without it does."""
    def answers(s):
        out = []
        for fields in ({"tool_choice": {"type": "function", "function": {"name": "set_level"}}},
                       {"tool_choice": "required", "parallel_tool_calls": False}, {"tool_choice": "auto"}):
            choice = chat(s, **fields)
            message = choice["message"]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
            out.append((choice["finish_reason"], message["content"], calls))
            streamed, finish = streamed_calls(s, **fields)
            out.append((finish, [(c["name"], c["arguments"]) for c in streamed]))
        return out

    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    s = RelayServer(relay_bin, "--model", qwen35_dir, "--served-model-name", NAME, "--speculative-config", ngram)
    s.wait_ready()
    try:
        assert answers(s) == answers(server)
        drafts = s.metrics()[f'relay:spec_decode_num_draft_tokens_total{{model_name="{NAME}"}}']
        assert drafts > 0
    finally:
        assert s.stop() == 0
