"""`relay serve` features through the official openai client, on the embedded demo model (CPU).

The demo model writes Python-like text, so tests compare the server with itself across paths that
must agree (streamed vs not, seeded runs, n choices) and check every field the API promises.
"""
import json

import pytest
import requests

from relay_server import MODEL, RelayServer, access_log_lines, completion_text

SYSTEM = ("You are a careful Python assistant. Answer with code only, no prose, and follow PEP 8. " * 6).strip()


@pytest.fixture(scope="module")
def server(relay_bin):
    s = RelayServer(relay_bin, "--max-num-seqs", 32)
    s.statuses_before_ready = s.wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, content, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_health_is_503_while_loading_then_200(server):
    assert server.statuses_before_ready[0] == 503
    assert server.statuses_before_ready[-1] == 200
    r = requests.get(server.base + "/health")
    assert r.status_code == 200


def test_load_progress_and_access_log(server, client):
    chat(client, "hi", max_tokens=2)
    log = server.log_text()
    assert "relay: loading" in log and "relay: loaded 'relay-demo-moe'" in log
    lines = access_log_lines(server, "/v1/chat/completions")
    assert lines and all(" 200 " in l for l in lines)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "relay"


def test_chat_completion_fields_and_usage(client):
    r = chat(client, "Write a function that adds two numbers.", max_tokens=10)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert r.usage.prompt_tokens > 5


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_completion_and_echo(client):
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    e = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=0, echo=True)
    assert e.choices[0].text == "def fib(n):" + r.choices[0].text


def test_completion_with_token_ids_prompt(client):
    text = completion_text(client, "import os", 6)
    # The same prompt as token ids (`relay tokenize` of "import os" is [474, 2643]).
    r = client.completions.create(model=MODEL, prompt=[474, 2643], max_tokens=6, temperature=0)
    assert r.choices[0].text == text


def test_streaming_chat_equals_non_streaming(client):
    full = chat(client, "Sort a list in Python.", max_tokens=20)
    stream = chat(client, "Sort a list in Python.", max_tokens=20, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_without_usage(client):
    full = completion_text(client, "class Stack:", 15)
    chunks = list(client.completions.create(model=MODEL, prompt="class Stack:", max_tokens=15, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert all(c.usage is None for c in chunks)


def test_sse_wire_format(server):
    r = requests.post(server.base + "/v1/chat/completions", stream=True, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [l for l in r.iter_lines(decode_unicode=True) if l]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_stop_strings(client):
    base = completion_text(client, "def fib(n):", 24)
    stop = base[6:9]
    assert stop.strip(), base
    expected = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == expected


def test_stop_token_ids(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "loop"}], max_tokens=12,
                                       temperature=0, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(e.token.removeprefix("token_id:")) for e in r.choices[0].logprobs.content]
    assert len(ids) == 12
    stopped = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "loop"}],
                                             max_tokens=12, temperature=0, extra_body={"stop_token_ids": [ids[3]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == ids.index(ids[3]) + 1
    # The stop token is generated but adds no text.
    assert len(stopped.choices[0].message.content) < len(r.choices[0].message.content)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"top_k": 50, "min_p": 0.01})
    a = chat(client, "Write a parser.", seed=1234, **kw).choices[0].message.content
    b = chat(client, "Write a parser.", seed=1234, **kw).choices[0].message.content
    c = chat(client, "Write a parser.", seed=99, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_n_choices(client):
    r = chat(client, "Write a parser.", n=3, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({c.message.content for c in r.choices}) > 1
    chunks = list(chat(client, "Write a parser.", n=3, temperature=1.0, seed=7, max_tokens=8, stream=True))
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_penalties_change_greedy_output(client):
    plain = completion_text(client, "x = 1\n", 40)
    penalised = client.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=40, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=1.5).choices[0].text
    assert plain != penalised


def test_chat_logprobs(client):
    r = chat(client, "Write a loop.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    text = ""
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        text += bytes(entry.bytes).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="def f():", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_ignore_eos_runs_to_max_tokens(client):
    r = chat(client, "Say nothing.", max_tokens=30, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30 and r.choices[0].finish_reason == "length"


def test_enable_thinking_controls_the_prompt(client):
    on = chat(client, "hi", max_tokens=2)
    off = chat(client, "hi", max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template closes an empty think block for enable_thinking=false.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert off.choices[0].message.reasoning_content is None


def test_tools_are_rendered_and_answer_is_well_formed(client):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    plain = chat(client, "Weather in Paris?", max_tokens=4)
    r = chat(client, "Weather in Paris?", max_tokens=4, tools=tools)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 30
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = chat(client, "Weather in Paris?", max_tokens=4, tools=tools, tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # A conversation that carries a tool call and its result renders and runs.
    follow = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}])
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens


def test_shared_system_prompt_hits_the_prefix_cache(server, client):
    before = server.metric("relay:prefix_cache_hits_total")
    msgs = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
    first = client.chat.completions.create(model=MODEL, messages=msgs("Reverse a string."), max_tokens=2,
                                           temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=msgs("Merge two dicts."), max_tokens=2,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 100
    assert cached >= 96 and cached % 16 == 0  # whole blocks of the shared system prompt
    assert server.metric("relay:prefix_cache_hits_total") - before >= cached


def test_metrics(server, client):
    chat(client, "hi", max_tokens=3)
    m = server.wait_idle()
    label = f'{{model_name="{MODEL}"}}'
    for name in ["relay:num_requests_running", "relay:num_requests_waiting", "relay:kv_cache_usage_perc",
                 "relay:prompt_tokens_total", "relay:generation_tokens_total", "relay:num_preemptions_total",
                 "relay:prefix_cache_queries_total", "relay:prefix_cache_hits_total",
                 "relay:time_to_first_token_seconds_count", "relay:inter_token_latency_seconds_count",
                 "relay:e2e_request_latency_seconds_count", "relay:request_queue_time_seconds_count"]:
        assert name + label in m, name
    assert m["relay:prompt_tokens_total" + label] > 0
    assert m["relay:generation_tokens_total" + label] >= 3
    assert m[f'relay:request_success_total{{model_name="{MODEL}",finished_reason="length"}}'] >= 1
    assert m["relay:e2e_request_latency_seconds_count" + label] >= 1
    assert m[f'relay:time_to_first_token_seconds_bucket{{model_name="{MODEL}",le="+Inf"}}'] == \
        m["relay:time_to_first_token_seconds_count" + label]
    text = requests.get(server.base + "/metrics").text
    assert "# TYPE relay:time_to_first_token_seconds histogram" in text
    assert m["relay:kv_cache_usage_perc" + label] == 0
    # Engine steps, decode-only apart from steps with prefill chunks: 3 tokens = 1 prefill step
    # (which samples the first) + 2 decode steps at least.
    kind = lambda k: f'{{model_name="{MODEL}",kind="{k}"}}'
    assert m["relay:engine_steps_total" + kind("mixed")] >= 1
    assert m["relay:engine_steps_total" + kind("decode")] >= 2
    assert m["relay:engine_step_sequences_total" + kind("decode")] >= m["relay:engine_steps_total" + kind("decode")]
    assert m["relay:engine_step_seconds_total" + kind("decode")] > 0
    # Its phases add up to the step time; delivery (off the engine thread) counts every output.
    phase = lambda p: f'relay:engine_step_phase_seconds_total{{model_name="{MODEL}",kind="decode",phase="{p}"}}'
    phases = [m[phase(p)] for p in ["schedule", "forward", "outputs", "handoff"]]
    assert all(v >= 0 for v in phases) and m[phase("forward")] > 0
    assert sum(phases) <= m["relay:engine_step_seconds_total" + kind("decode")] * 1.001 + 1e-6
    assert m["relay:output_deliveries_total" + label] >= 3
    assert m["relay:output_delivery_seconds_total" + label] > 0


def test_tokenize_detokenize_and_version(server, client):
    """vLLM's /tokenize, /detokenize and /version: ids as HF `tokenizers` encodes them, a chat's ids
    as /v1/chat/completions counts them, and errors as OpenAI error bodies."""
    from tokenizers import Tokenizer

    from conftest import DEMO_MODEL
    hf = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    text = "def héllo(world):\n    return 'ünïcode' + \"<|im_end|>\""
    r = requests.post(server.base + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf.encode(text).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["token_strs"] == [hf.id_to_token(i) for i in body["tokens"]]

    messages = [{"role": "user", "content": "Write a stack class."}]
    r = requests.post(server.base + "/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert r.json()["count"] == usage.prompt_tokens and r.json()["token_strs"] is None

    r = requests.post(server.base + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(body["tokens"], skip_special_tokens=False)}

    for path, payload, status, param in [
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, "messages"),
            ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
            ("/detokenize", {"tokens": [1, -5]}, 400, "tokens"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")]:
        r = requests.post(server.base + path, json=payload)
        assert r.status_code == status, (path, payload, r.text)
        assert r.json()["error"]["param"] == param, r.text

    r = requests.get(server.base + "/version")
    assert r.status_code == 200 and r.json()["version"]
