"""Disaggregated serving on loopback: a router, prefill workers and decode workers as separate
processes, the KV handed over by UCX. The text equals the single-process server's (greedy), across
mismatched sharding (prefill TP 2 -> decode DP 2 + EP 2); prompt logprobs (a max_tokens 0 scoring
request included), structured outputs, forced tool calls and logit_bias give what the single-process
server gives; a decode worker killed mid-stream fails only its requests and is marked down, and is
used again once it re-joins; a KV hand-off that misses its deadline fails that request cleanly and
frees the blocks on both sides; the router exports the autoscaling signals."""
import concurrent.futures as cf
import hashlib
import hmac
import json
import re
import secrets
import signal
import subprocess
import time

import httpx
import pytest
import requests

from relay_server import MODEL, RelayServer

PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef normalize(x):", "class Queue:\n    def push(self, item):",
           "for i in range(10):"]
PROMPT_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562]  # "The quick brown fox jumps over the lazy dog"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "count": {"type": "integer", "enum": [1, 2, 3]}},
          "required": ["answer", "count"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "set_mode", "parameters": {"type": "object", "properties": {"mode": {"type": "string", "enum": ["fast", "safe"]}},
                                       "required": ["mode"]}}},
    {"type": "function", "function": {"name": "stop_all", "parameters": {"type": "object", "properties": {}}}}]


def complete(client, prompt, max_tokens=20, stream=False):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream,
                                  extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in r)
    return r.choices[0].text


def post(server, path, body):
    r = requests.post(server.base + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def constrained_answers(server):
    """The answers that need prompt logprobs or token constraints, as the tests below compare them."""
    chat = [{"role": "user", "content": "Answer."}]
    x = requests.post(server.base + "/tokenize", json={"prompt": "x"}, timeout=10).json()["tokens"][0]
    return {
        # lm-eval's loglikelihood request: the prompt scored, nothing generated.
        "score": post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 2,
                                                  "max_tokens": 0})["choices"][0],
        # Prompt logprobs beside generated tokens (the prefill worker scores, the decode worker continues).
        "prompt_logprobs": post(server, "/v1/completions", {"prompt": PROMPT_IDS, "prompt_logprobs": 1,
                                                            "max_tokens": 3, "temperature": 0})["choices"][0],
        "json": post(server, "/v1/chat/completions", {
            "messages": chat, "max_tokens": 400, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
        })["choices"][0],
        "tools": post(server, "/v1/chat/completions", {"messages": chat, "max_tokens": 60, "temperature": 0,
                                                       "tools": TOOLS, "tool_choice": "required",
                                                       "parallel_tool_calls": False})["choices"][0],
        "biased": post(server, "/v1/completions", {"prompt": "def answer():\n    return ", "max_tokens": 4,
                                                   "temperature": 0, "logit_bias": {str(x): 100}})["choices"][0],
        "unbiased": post(server, "/v1/completions", {"prompt": "def answer():\n    return ", "max_tokens": 4,
                                                     "temperature": 0})["choices"][0],
    }


def workers(router):
    headers = {"Authorization": f"Bearer {router.api_key}"} if router.api_key else {}
    return requests.get(router.base + "/disagg/workers", headers=headers, timeout=5).json()


def wait_workers(router, expected_up, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        up = sorted((w["role"], w["url"]) for w in workers(router) if w["up"])
        if len(up) == expected_up:
            return up
        time.sleep(0.1)
    raise AssertionError(f"workers not up: {workers(router)}")


class Deployment:
    def __init__(self, relay_bin, prefill_args=(), decode_args=(), router_args=(), secret_file=None, api_key=None):
        self.relay_bin = relay_bin
        self.secret_args = ("--disagg-secret-file", secret_file) if secret_file else ()
        self.router = RelayServer(relay_bin, "--role", "router", "--heartbeat-interval", 0.2, *self.secret_args,
                                  *router_args, api_key=api_key)
        self.router.wait_ready(path="/version")
        # No worker yet: the router is unhealthy and says why, and a request fails at once with 503.
        # (/version answers while the router still loads, when /health says only "loading".)
        deadline = time.time() + 30
        health = requests.get(self.router.base + "/health", timeout=5)
        while health.json().get("status") == "loading" and time.time() < deadline:
            time.sleep(0.05)
            health = requests.get(self.router.base + "/health", timeout=5)
        assert health.status_code == 503 and health.json().get("reason") == "no prefill or decode worker is up", \
            health.text
        start = time.time()
        r = requests.post(self.router.base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        assert r.status_code == 503 and time.time() - start < 2, (r.status_code, r.text)
        assert r.json()["error"]["type"] == "service_unavailable"
        self.prefill = self.worker("prefill", *prefill_args)
        self.decode = self.worker("decode", *decode_args)
        wait_workers(self.router, 2)
        assert requests.get(self.router.base + "/health", timeout=5).status_code == 200

    def worker(self, role, *args, port=None):
        w = RelayServer(self.relay_bin, "--role", role, "--router", f"127.0.0.1:{self.router.port}",
                        "--heartbeat-interval", 0.2, *self.secret_args, *args, port=port)
        w.wait_ready()
        return w

    def stop(self):
        for s in (self.router, self.prefill, self.decode):
            if s.proc.poll() is None:
                assert s.stop() == 0, s.log_text()


@pytest.fixture(scope="module")
def colocated(relay_bin):
    s = RelayServer(relay_bin)
    s.wait_ready()
    client = s.client()
    want = {p: complete(client, p) for p in PROMPTS}
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "Write a sort function."}])
    want["chat"] = chat.choices[0].message.content
    want["constrained"] = constrained_answers(s)
    assert s.stop() == 0
    return want


@pytest.fixture(scope="module")
def deployment(relay_bin):
    d = Deployment(relay_bin)
    yield d
    d.stop()


def test_disaggregated_text_equals_colocated(deployment, colocated):
    client = deployment.router.client()
    for p in PROMPTS:
        assert complete(client, p) == colocated[p]
        assert complete(client, p, stream=True) == colocated[p]
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": "Write a sort function."}])
    assert chat.choices[0].message.content == colocated["chat"]
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: complete(client, p), PROMPTS * 2))
    assert got == [colocated[p] for p in PROMPTS * 2]
    # Every page went back: nothing held on the prefill side, nothing reserved on the decode side.
    for w in (deployment.prefill, deployment.decode):
        assert w.wait_idle()["relay:kv_cache_usage_perc{model_name=\"relay-demo-moe\"}"] == 0


def test_a_prefix_the_decode_worker_holds_is_not_sent_again(deployment):
    system = "You are a careful Python reviewer. " * 12  # ~100 tokens, several full blocks
    client = deployment.router.client()
    for question in ["def add(a, b):", "def sub(a, b):"]:
        client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    handoffs = [int(n) for n in re.findall(r"KV hand-off: (\d+) tokens", deployment.prefill.log_text())]
    # The second prompt shares the first's system prompt: only its tail moved.
    assert len(handoffs) >= 2 and handoffs[-1] < handoffs[-2] - 64, handoffs


def test_client_disconnect_aborts_on_the_decode_worker(deployment):
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", deployment.router.base + "/v1/completions", json={
                "model": MODEL, "prompt": "class Tree:", "max_tokens": 3000, "stream": True,
                "ignore_eos": True, "temperature": 0}) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(10))
            assert deployment.decode.metric("relay:kv_cache_usage_perc") > 0
    # The client hung up: the router closes its stream, the decode worker aborts and frees the pages.
    m = deployment.decode.wait_idle(timeout=15)
    assert m[f'relay:kv_cache_usage_perc{{model_name="{MODEL}"}}'] == 0
    assert deployment.decode.metric("relay:request_success_total", finished_reason="abort") >= 1
    assert deployment.decode.metric("relay:generation_tokens_total") < 3000
    assert deployment.router.wait_idle(timeout=15)[f'relay:num_requests_running{{model_name="{MODEL}"}}'] == 0


@pytest.fixture(scope="module")
def constrained(deployment):
    """The router's constrained answers, with how many requests the decode worker saw meanwhile."""
    def decode_requests():
        return sum(deployment.decode.metric("relay:request_success_total", finished_reason=reason)
                   for reason in ("stop", "length", "abort", "error"))
    before = decode_requests()
    got = constrained_answers(deployment.router)
    return got, decode_requests() - before


def test_prompt_logprobs_through_the_router(deployment, colocated, constrained):
    got, _ = constrained
    want = colocated["constrained"]
    # A scoring request (echo + logprobs, max_tokens 0) ends on the prefill worker.
    score, want_score = got["score"], want["score"]
    assert score["finish_reason"] == "length" and score["text"] == want_score["text"]
    lp, want_lp = score["logprobs"], want_score["logprobs"]
    assert lp["tokens"] == want_lp["tokens"] and lp["text_offset"] == want_lp["text_offset"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(PROMPT_IDS)):
        assert abs(lp["token_logprobs"][pos] - want_lp["token_logprobs"][pos]) < 1e-4
        assert lp["top_logprobs"][pos].keys() == want_lp["top_logprobs"][pos].keys()
        for token, value in lp["top_logprobs"][pos].items():
            assert abs(value - want_lp["top_logprobs"][pos][token]) < 1e-4
    # vLLM's prompt_logprobs with generated tokens after them: ranks and decoded tokens included.
    rows, want_rows = got["prompt_logprobs"]["prompt_logprobs"], want["prompt_logprobs"]["prompt_logprobs"]
    assert len(rows) == len(PROMPT_IDS) and rows[0] is None
    for row, want_row in zip(rows[1:], want_rows[1:]):
        assert row.keys() == want_row.keys()
        for token, entry in row.items():
            assert entry["rank"] == want_row[token]["rank"]
            assert entry["decoded_token"] == want_row[token]["decoded_token"]
            assert abs(entry["logprob"] - want_row[token]["logprob"]) < 1e-4
    assert got["prompt_logprobs"]["text"] == want["prompt_logprobs"]["text"]


def test_a_scoring_request_takes_no_decode_worker(constrained):
    # Only the five requests that generate reached the decode worker.
    _, num_decoded = constrained
    assert num_decoded == 5


def test_structured_outputs_through_the_router(deployment, colocated, constrained):
    got, _ = constrained
    choice = got["json"]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"answer", "count"} and value["answer"] in ("yes", "no") and value["count"] in (1, 2, 3)
    assert choice["message"]["content"] == colocated["constrained"]["json"]["message"]["content"]
    # The router compiles the grammar as a single server does, so a bad schema is its 400.
    r = requests.post(deployment.router.base + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text


def test_forced_tool_call_through_the_router(colocated, constrained):
    got, _ = constrained
    choice = got["tools"]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] in ("set_mode", "stop_all") for c in calls)
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] == "set_mode":
            assert args["mode"] in ("fast", "safe")
    want = colocated["constrained"]["tools"]["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [c["function"] for c in want]


def test_logit_bias_through_the_router(deployment, colocated, constrained):
    got, _ = constrained
    want = colocated["constrained"]
    assert got["biased"]["text"] == want["biased"]["text"] == "xxxx"
    assert got["unbiased"]["text"] == want["unbiased"]["text"] != "xxxx"
    # Every page went back on both sides.
    for w in (deployment.prefill, deployment.decode):
        assert w.wait_idle()[f'relay:kv_cache_usage_perc{{model_name="{MODEL}"}}'] == 0


def test_router_exports_autoscaling_signals(deployment):
    m = deployment.router.metrics()
    label = '{model_name="relay-demo-moe"}'
    assert m["relay:prefill_workers_up" + label] == 1 and m["relay:decode_workers_up" + label] == 1
    assert m["relay:prefill_replicas_needed" + label] >= 1 and m["relay:decode_replicas_needed" + label] >= 1
    assert m["relay:prompt_tokens_per_second" + label] > 0


def test_mismatched_sharding_prefill_tp2_to_decode_dp2(relay_bin, colocated):
    d = Deployment(relay_bin, prefill_args=("--tp", 2), decode_args=("--dp", 2, "--ep", 2, "--num-kv-blocks", 300))
    try:
        # Workers register their layout and capacity.
        by_role = {w["role"]: w for w in workers(d.router)}
        assert by_role["prefill"]["layout"] == "tp=2 ep=1 dp=1" and by_role["prefill"]["kv_transport"] == "ucx"
        assert by_role["decode"]["layout"] == "tp=1 ep=2 dp=2" and by_role["decode"]["num_kv_blocks"] == 600
        assert by_role["decode"]["max_num_seqs"] == 64 and by_role["decode"]["block_size"] == 16
        client = d.router.client()
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(client, p), PROMPTS))
        assert got == [colocated[p] for p in PROMPTS]
    finally:
        d.stop()


def test_decode_worker_dies_mid_stream_then_rejoins(relay_bin, colocated):
    d = Deployment(relay_bin, router_args=("--worker-wait", 2))
    try:
        client = d.router.client()
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        with cf.ThreadPoolExecutor(1) as pool:
            # A non-streaming request in flight too: it must fail with an error status, not 200.
            pending = pool.submit(requests.post, d.router.base + "/v1/completions", timeout=60,
                                  json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2000, "ignore_eos": True})
            time.sleep(1.0)
            d.decode.proc.send_signal(signal.SIGKILL)
            d.decode.proc.wait()
            with pytest.raises(Exception):
                for _ in stream:
                    pass
            failed = pending.result()
        assert failed.status_code == 502, failed.text
        assert "decode worker" in failed.json()["error"]["message"]
        # The router marks it down; with no decode worker a new request is refused at once, and
        # the router's /health says why.
        deadline = time.time() + 10
        while any(w["up"] for w in workers(d.router) if w["role"] == "decode") and time.time() < deadline:
            time.sleep(0.1)
        assert not any(w["up"] for w in workers(d.router) if w["role"] == "decode")
        start = time.time()
        r = requests.post(d.router.base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                          timeout=30)
        assert r.status_code == 503 and time.time() - start < 2, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "decode" in err["message"], r.text
        health = requests.get(d.router.base + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["reason"] == "no decode worker is up"
        # The same worker comes back on the same address and is used again.
        port = d.decode.port
        d.decode = d.worker("decode", port=port)
        wait_workers(d.router, 2)
        assert complete(client, PROMPTS[1]) == colocated[PROMPTS[1]]
    finally:
        d.stop()


def test_a_dead_prefill_workers_requests_go_to_another(relay_bin, colocated):
    d = Deployment(relay_bin)
    try:
        spare = d.worker("prefill")
        wait_workers(d.router, 3)
        # Killed without a word: until its heartbeats are missed the router may still pick it, and
        # then re-sends the prompt to the other prefill worker.
        d.prefill.proc.send_signal(signal.SIGKILL)
        d.prefill.proc.wait()
        client = d.router.client()
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: complete(client, p), PROMPTS))
        assert got == [colocated[p] for p in PROMPTS]
        dead = [w for w in workers(d.router) if w["url"] == d.prefill.base]
        assert dead and not dead[0]["up"]
        assert spare.stop() == 0
    finally:
        d.stop()


def test_kv_handoff_past_its_deadline_fails_cleanly(relay_bin):
    d = Deployment(relay_bin, prefill_args=("--kv-transfer-timeout", 0.000001))
    try:
        r = requests.post(d.router.base + "/v1/completions",
                          json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 4}, timeout=60)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "deadline" in err["message"], r.text
        for w in (d.prefill, d.decode):
            assert w.wait_idle()["relay:kv_cache_usage_perc{model_name=\"relay-demo-moe\"}"] == 0
    finally:
        d.stop()


def signed(secret, method, path, body, timestamp=None, nonce=None):
    """The control plane's signature headers (disagg/auth.h), computed independently of Relay."""
    timestamp = str(int(time.time()) if timestamp is None else timestamp)
    nonce = nonce or secrets.token_hex(16)
    message = "\n".join([method, path, timestamp, nonce, hashlib.sha256(body).hexdigest()]).encode()
    signature = hmac.new(secret, message, hashlib.sha256).hexdigest()
    return {"X-Relay-Timestamp": timestamp, "X-Relay-Nonce": nonce, "X-Relay-Signature": signature}


def test_authenticated_control_plane(relay_bin, colocated, tmp_path):
    secret = secrets.token_hex(32).encode()
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(secret + b"\n")
    d = Deployment(relay_bin, secret_file=secret_file, api_key="sk-test")
    try:
        # The deployment works as before, its messages signed.
        client = d.router.client()
        assert complete(client, PROMPTS[0]) == colocated[PROMPTS[0]]
        router, decode = d.router.base, d.decode.base
        beat = json.dumps({"url": "http://127.0.0.1:9", "role": "decode", "num_running": 0, "num_waiting": 0,
                           "kv_cache_usage": 0, "queued_prompt_tokens": 0, "prefill_tokens_total": 0,
                           "max_num_seqs": 64, "num_kv_blocks": 1000, "block_size": 16, "layout": "tp=1",
                           "kv_transport": "ucx"}).encode()
        # A fake decode worker's heartbeat: unsigned, signed with another secret, or replayed.
        r = requests.post(router + "/disagg/heartbeat", data=beat, timeout=5)
        assert r.status_code == 401 and "unsigned" in r.json()["error"]
        r = requests.post(router + "/disagg/heartbeat", data=beat, timeout=5,
                          headers=signed(b"another secret of 32 bytes......", "POST", "/disagg/heartbeat", beat))
        assert r.status_code == 401 and "wrong signature" in r.json()["error"]
        old = signed(secret, "POST", "/disagg/heartbeat", beat, timestamp=int(time.time()) - 600)
        r = requests.post(router + "/disagg/heartbeat", data=beat, timeout=5, headers=old)
        assert r.status_code == 401 and "window" in r.json()["error"]
        assert sorted(w["url"] for w in workers(d.router)) == sorted([d.prefill.base, d.decode.base])
        # /disagg/workers needs the API key (or a signature).
        assert requests.get(router + "/disagg/workers", timeout=5).status_code == 401
        # A worker obeys only signed messages: no reservation for a stranger, nor a replayed one.
        body = json.dumps({"prompt": [1, 2, 3]}).encode()
        r = requests.post(decode + "/disagg/reserve", data=body, timeout=5)
        assert r.status_code == 401
        headers = signed(secret, "POST", "/disagg/reserve", body)
        r = requests.post(decode + "/disagg/reserve", data=body, timeout=5, headers=headers)
        assert r.status_code == 200, r.text
        release = json.dumps({"id": r.json()["id"]}).encode()
        assert requests.post(decode + "/disagg/release", data=release, timeout=5,
                             headers=signed(secret, "POST", "/disagg/release", release)).status_code == 200
        r = requests.post(decode + "/disagg/reserve", data=body, timeout=5, headers=headers)
        assert r.status_code == 401 and "replayed" in r.json()["error"]
        # A worker started with another secret never joins, and says why in its log.
        wrong = tmp_path / "wrong"
        wrong.write_text(secrets.token_hex(32))
        stranger = RelayServer(relay_bin, "--role", "decode", "--router", f"127.0.0.1:{d.router.port}",
                               "--heartbeat-interval", 0.2, "--disagg-secret-file", wrong)
        stranger.wait_ready()
        time.sleep(1.0)
        assert stranger.base not in [w["url"] for w in workers(d.router)]
        assert "the router refused this worker's heartbeat" in stranger.log_text()
        assert stranger.stop() == 0
    finally:
        d.stop()


def test_a_control_plane_open_to_the_network_needs_a_secret(relay_bin):
    for role in ("router", "prefill", "decode"):
        proc = subprocess.run([str(relay_bin), "serve", "--role", role, "--host", "0.0.0.0", "--port", "0"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "--disagg-secret-file" in proc.stderr, proc.stderr
