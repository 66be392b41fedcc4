"""Bad input to `relay serve`: each gets an OpenAI-style error body with the right status, type,
param and code, and none of them disturbs a request that is running at the same time."""
import threading

import openai
import pytest
import requests

from relay_server import MODEL, RelayServer

KEY = "sk-relay-test"


@pytest.fixture(scope="module")
def server(relay_bin):
    s = RelayServer(relay_bin, "--max-num-seqs", 2, "--max-queue", 2, "--max-model-len", 512, api_key=KEY)
    s.wait_ready()
    yield s
    assert s.stop() == 0


def post(server, path, body=None, data=None, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
        return requests.post(server.base + path, data=data, headers=headers, timeout=60)
    return requests.post(server.base + path, json=body, headers=headers, timeout=60)


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def with_fields(**fields):
    body = dict(CHAT)
    body.update(fields)
    return body


@pytest.mark.parametrize("body,param", [
    (with_fields(messages=[]), "messages"),
    (with_fields(messages="hello"), "messages"),
    ({"model": MODEL}, "messages"),
    (with_fields(messages=[{"role": "pirate", "content": "arr"}]), "messages[0].role"),
    (with_fields(messages=[{"role": "user"}]), "messages[0].content"),
    (with_fields(temperature="hot"), "temperature"),
    (with_fields(temperature=-0.5), "temperature"),
    (with_fields(top_p=0), "top_p"),
    (with_fields(top_k=2.5), "top_k"),
    (with_fields(min_p=1.5), "min_p"),
    (with_fields(max_tokens=0), "max_tokens"),
    (with_fields(max_tokens="many"), "max_tokens"),
    (with_fields(n=0), "n"),
    (with_fields(presence_penalty=9), "presence_penalty"),
    (with_fields(seed="abc"), "seed"),
    (with_fields(stop=7), "stop"),
    (with_fields(stop_token_ids=[-1]), "stop_token_ids"),
    (with_fields(stop_token_ids=[10_000_000]), "stop_token_ids"),
    (with_fields(logprobs=True, top_logprobs=99), "top_logprobs"),
    (with_fields(top_logprobs=2), "top_logprobs"),
    (with_fields(stream_options={"include_usage": True}), "stream_options"),
    (with_fields(tools=[{"type": "function"}]), "tools[0]"),
    (with_fields(chat_template_kwargs=[1]), "chat_template_kwargs"),
])
def test_bad_chat_fields_name_the_parameter(server, body, param):
    err = error_of(post(server, "/v1/chat/completions", body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [1, -4]}, "prompt"),
    ({"model": MODEL, "prompt": [10_000_000]}, "prompt"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, "logprobs"),
])
def test_bad_completion_fields(server, body, param):
    assert error_of(post(server, "/v1/completions", body), 400)["param"] == param


@pytest.mark.parametrize("data", ["{", "not json", "[1, 2]", '{"model": "m",}', ""])
def test_malformed_json(server, data):
    err = error_of(post(server, "/v1/chat/completions", data=data), 400)
    assert err["type"] == "invalid_request_error"


def test_context_length_exceeded(server):
    err = error_of(post(server, "/v1/chat/completions", with_fields(max_tokens=600)), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "512" in err["message"]
    long_prompt = "x = 1\n" * 400
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    # Through the client, the same error is an openai.BadRequestError.
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_api_key(server):
    assert error_of(post(server, "/v1/chat/completions", CHAT, key=None), 401)["code"] == "invalid_api_key"
    assert error_of(post(server, "/v1/chat/completions", CHAT, key="wrong"), 401)["code"] == "invalid_api_key"
    r = requests.get(server.base + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert requests.get(server.base + "/health").status_code == 200  # health stays open
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200


def test_unknown_model_and_route(server):
    err = error_of(post(server, "/v1/chat/completions", with_fields(model="gpt-9")), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    err = error_of(post(server, "/v1/embeddings", {"model": MODEL, "input": "x"}), 404)
    assert err["code"] == "not_found"
    assert requests.get(server.base + "/nowhere").status_code == 404


def test_full_queue_gets_429_and_others_are_undisturbed(server):
    # 2 running + 2 queued fill the server; the rest are refused at once with 429.
    client = server.client()
    results, errors = [], []

    def long_request():
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                               max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = 50
    while server.metric("relay:num_requests_running") + server.metric("relay:num_requests_waiting") < 4 and deadline:
        deadline -= 1
        threading.Event().wait(0.1)
    r = post(server, "/v1/chat/completions", CHAT)
    err = error_of(r, 429)
    assert err["code"] == "queue_full"
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)
    # Bad requests while the server is busy are answered without touching the running ones.
    assert post(server, "/v1/chat/completions", data="{oops").status_code == 400
    for t in threads:
        t.join()
    assert errors == [] and results == [150] * 4
    assert server.metric("relay:request_rejected_total", status=429) >= 2
    server.wait_idle()


def test_unknown_fields_are_ignored_as_vllm_ignores_them(server):
    # Fields newer OpenAI clients send: accepted and ignored (and logged once each).
    body = with_fields(reasoning_effort="low", modalities=["text"], prediction={"type": "content", "content": "x"},
                       verbosity="low", audio=None, max_tokens=2)
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    log = server.log_text()
    for name in ("reasoning_effort", "modalities", "prediction", "verbosity"):
        assert log.count(f"ignoring the unknown request field '{name}'") == 1, name
    assert "'audio'" not in log
