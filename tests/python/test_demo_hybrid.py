"""The trained demo hybrid (models/relay-demo-hybrid: a Qwen3.5-MoE with its own trained MTP head) with MTP
speculative decoding end to end, against what its recipe measured in torch
(tests/fixtures/models/relay-demo-hybrid-expected): `relay generate` writes transformers' greedy continuation with
K = 1, 2, 3 as without speculation, and `relay serve` with MTP on answers the 12 fixture prompts, sent together,
with the tokens it answers without, while its spec-decode counters in /metrics move and accept about as many
drafts as torch's teacher-forced figure. The exact counts and the teacher-forced checks are in
tests/unit/engine/test_demo_hybrid_engine.cpp and tests/unit/model/test_demo_hybrid.cpp."""
import concurrent.futures as cf
import json
import re
import subprocess

import requests

from conftest import FIXTURES, ROOT
from relay_server import RelayServer

HYBRID = ROOT / "models" / "relay-demo-hybrid"
NAME = "relay-demo-hybrid"
EXPECTED = json.loads((FIXTURES / "models" / "relay-demo-hybrid-expected" / "expected_demo_hybrid.json").read_text())
SAMPLES = EXPECTED["samples"]


def mtp(k):
    return json.dumps({"method": "mtp", "num_speculative_tokens": k})


def test_generate_with_mtp_writes_transformers_greedy_text(relay_bin):
    sample = SAMPLES[0]  # "def fibonacci(n):\n"

    def generate(*args):
        r = subprocess.run([str(relay_bin), "generate", "--model", str(HYBRID), "--prompt", sample["prompt"],
                            "--max-tokens", str(len(sample["generated_ids"])), "--ignore-eos", "--threads", "2", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr
    plain, _ = generate()
    assert plain == sample["text"] + "\n"
    for k in (1, 2, 3):
        text, log = generate("--speculative-config", mtp(k))
        assert text == plain, k
        m = re.search(rf"speculative decoding \(mtp k={k}\): (\d+) of (\d+) drafts accepted", log)
        assert m and 0 < int(m.group(1)) <= int(m.group(2)), log


def serve(relay_bin, *args):
    """Every fixture prompt at once (greedy, 64 tokens each) → (token ids, text) per prompt, and /metrics."""
    server = RelayServer(relay_bin, "--model", HYBRID, "--max-num-seqs", 12, "--max-num-batched-tokens", 64, *args)
    server.wait_ready()
    try:
        def one(s):
            body = {"model": NAME, "prompt": s["prompt_ids"], "max_tokens": len(s["generated_ids"]),
                    "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
            r = requests.post(server.base + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]], choice["text"]
        with cf.ThreadPoolExecutor(len(SAMPLES)) as pool:
            outputs = list(pool.map(one, SAMPLES))
        metrics = server.wait_idle(model=NAME)
    finally:
        assert server.stop() == 0
    return outputs, metrics


def test_server_with_mtp_answers_as_without_and_counts_the_drafts(relay_bin):
    plain, plain_metrics = serve(relay_bin)
    spec, metrics = serve(relay_bin, "--speculative-config", mtp(1))
    assert spec == plain
    # No top-2 margin along these paths is near a tie (the smallest is 3.5e-3), so every token is transformers'.
    assert [ids for ids, _ in plain] == [s["generated_ids"] for s in SAMPLES]
    label = f'{{model_name="{NAME}"}}'
    assert plain_metrics["relay:spec_decode_num_drafts_total" + label] == 0
    num_drafts = metrics["relay:spec_decode_num_drafts_total" + label]
    drafted = metrics["relay:spec_decode_num_draft_tokens_total" + label]
    accepted = metrics["relay:spec_decode_num_accepted_tokens_total" + label]
    assert num_drafts > 0 and drafted == num_drafts
    assert metrics[f'relay:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{NAME}",position="0"}}'] == accepted
    # The positions a K = 1 decode drafts skip each accepted draft's bonus token, so the rate sits a little below
    # the teacher-forced figure (test_demo_hybrid_engine.cpp predicts it exactly).
    assert abs(accepted / drafted - EXPECTED["mtp_acceptance_k1"]) <= 0.05, (accepted, drafted)
