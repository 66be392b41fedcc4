"""Prompt logprobs through the OpenAI API, as vLLM serves them: completions with `echo` and `logprobs`
(the prompt's tokens lead the logprobs, the first with none), `max_tokens: 0` with echo, batches of
prompts in one request, vLLM's `prompt_logprobs` on completions and chat, and `stop_reason` and
/tokenizer_info beside them. The numbers are checked against `relay score`'s fp32 logits."""
import json
import subprocess

import numpy as np
import pytest
import requests

from conftest import DEMO_MODEL
from relay_server import MODEL, server_fixture

PROMPT_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562]  # "The quick brown fox jumps over the lazy dog"


server = server_fixture()


@pytest.fixture(scope="module")
def reference(relay_bin, tmp_path_factory):
    """log-softmax of `relay score`'s logits of PROMPT_IDS: row p scores token p + 1."""
    tmp = tmp_path_factory.mktemp("score")
    (tmp / "prompts.json").write_text(json.dumps([PROMPT_IDS]))
    out = tmp / "logits.f32"
    r = subprocess.run([str(relay_bin), "score", "--prompts", str(tmp / "prompts.json"), "--out", str(out),
                        "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    logits = np.fromfile(out, dtype="<f4").reshape(meta["num_rows"], meta["vocab_size"]).astype(np.float64)
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


def post(server, path, body):
    return requests.post(server.base + path, json={"model": MODEL, **body}, timeout=120)


def test_echo_with_logprobs_scores_the_prompt(server, reference):
    r = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert choice["text"] == "The quick brown fox jumps over the lazy dog"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(PROMPT_IDS)):
        want = reference[pos - 1]
        assert abs(lp["token_logprobs"][pos] - want[PROMPT_IDS[pos]]) < 1e-4
        # The top 2 and the prompt token itself, as vLLM lists them.
        best = max(lp["top_logprobs"][pos].values())
        assert abs(best - want.max()) < 1e-4 and len(lp["top_logprobs"][pos]) in (2, 3)
    assert lp["text_offset"][:3] == [0, 3, 9]


def test_echo_without_logprobs_and_max_tokens_zero(server):
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "echo": True, "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "def f(x):"
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_batch_of_prompts_answers_each_in_order(server):
    prompts = ["def fibonacci(n):", [785, 3974, 13876], "import os\n"]
    singles = [post(server, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0}).json()
               for p in prompts]
    r = post(server, "/v1/completions", {"prompt": [prompts[0], prompts[2]], "max_tokens": 6, "temperature": 0,
                                         "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    # choice index = prompt index * n + sample index
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [singles[0]["choices"][0]["text"]] * 2 + [singles[2]["choices"][0]["text"]] * 2
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"] + singles[2]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 4 * 6
    # Token-id batches, streamed: every choice's chunks carry its index.
    r = requests.post(server.base + "/v1/completions", stream=True, timeout=120, json={
        "model": MODEL, "prompt": [[785, 3974], [1, 2, 3]], "max_tokens": 3, "stream": True, "temperature": 0})
    seen = set()
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            seen.update(c["index"] for c in json.loads(line[6:])["choices"])
    assert seen == {0, 1}


def test_streamed_echo_leads_with_the_prompt_and_its_logprobs(server, reference):
    r = requests.post(server.base + "/v1/completions", stream=True, timeout=120, json={
        "model": MODEL, "prompt": PROMPT_IDS, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
        "stream": True})
    chunks = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith(b"data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("The quick brown fox jumps over the lazy dog")
    lp = first["logprobs"]
    assert lp["token_logprobs"][0] is None
    assert abs(lp["token_logprobs"][1] - reference[0][PROMPT_IDS[1]]) < 1e-4
    # text_offset runs on across chunks.
    offsets = [o for c in chunks for ch in c["choices"] if ch.get("logprobs") for o in ch["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and len(offsets) == len(PROMPT_IDS) + 3


def test_vllm_prompt_logprobs_field(server, reference):
    r = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "prompt_logprobs": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(PROMPT_IDS) and pl[0] is None
    for pos in range(1, len(PROMPT_IDS)):
        entry = pl[pos]
        mine = entry[str(PROMPT_IDS[pos])]
        assert abs(mine["logprob"] - reference[pos - 1][PROMPT_IDS[pos]]) < 1e-4
        assert mine["rank"] == 1 + int((reference[pos - 1] > reference[pos - 1][PROMPT_IDS[pos]]).sum())
        assert any(v["rank"] == 1 for v in entry.values())
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "prompt_logprobs": 0, "max_tokens": 1})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    assert len(chat.json()["prompt_logprobs"]) == chat.json()["usage"]["prompt_tokens"]
    streamed = post(server, "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_stop_reason(server):
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 30, "temperature": 0, "stop": ["\n"]})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["choices"][0]["stop_reason"] == "\n"
    # The first token the model writes, as a stop token id.
    token = int(server.client().completions.create(model=MODEL, prompt="def f(x):", max_tokens=1, temperature=0,
                                                    logprobs=0, extra_body={"return_tokens_as_token_ids": True})
                .choices[0].logprobs.tokens[0].split(":")[1])
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0,
                                         "stop_token_ids": [token]})
    assert r.json()["choices"][0]["stop_reason"] == token, r.json()
    r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 2})
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["choices"][0]["stop_reason"] is None


def test_tokenizer_info(server):
    info = requests.get(server.base + "/tokenizer_info", timeout=10).json()
    config = json.loads((DEMO_MODEL / "tokenizer_config.json").read_text())
    assert info["eos_token"] == config["eos_token"] and info["chat_template"] == config["chat_template"]
    assert info["tokenizer_class"] == "Qwen2Tokenizer" and info["model_max_length"] == 4096


def test_the_openai_client_reads_echoed_logprobs(server, reference):
    r = server.client().completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=1, max_tokens=1,
                                           temperature=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT_IDS) + 1
    assert abs(lp.token_logprobs[2] - reference[1][PROMPT_IDS[2]]) < 1e-4
    assert r.choices[0].text.startswith("The quick brown fox")
