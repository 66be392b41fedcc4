"""Speculative decoding (`--speculative-config`, vLLM's JSON) through `relay generate` and the server: with
n-gram drafts the output is token for token the output without them (greedy and seeded sampling, with chunked
prefill, a prefix hit and preemption in the run) and the spec-decode metrics count the drafts; with MTP drafts
from a separate head directory ("model": DIR, a Qwen3-MoE target that ships none) `relay generate` writes the
same text as without; per-request draft lengths (min_draft_acceptance) leave the server's answers unchanged;
configurations that cannot run fail at start with a message naming the field or file.
MTP on the hybrid checkpoints' own heads is in test_hybrid_serving.py."""
import concurrent.futures as cf
import json
import shutil
import subprocess

import pytest
import requests

from conftest import FIXTURES, ROOT
from relay_server import MODEL, RelayServer

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "import os\nimport sys\nimport os\nimport",
           "class Tree:\n    def __init__(self, left, right):\n        self.left = left\n", "for i in range(10):"]


def generate(relay_bin, *args):
    r = subprocess.run([str(relay_bin), "generate", "--prompt", PROMPTS[0], "--max-tokens", "48", "--ignore-eos",
                        "--threads", "2", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


def test_generate_with_ngram_drafts_writes_the_same_text(relay_bin):
    plain, _ = generate(relay_bin)
    spec, log = generate(relay_bin, "--speculative-config", NGRAM)
    assert spec == plain
    assert "speculative decoding (ngram k=4 lookup 1..4):" in log and "drafts accepted" in log
    sampled, _ = generate(relay_bin, "--temperature", "0.8", "--seed", "5")
    assert generate(relay_bin, "--temperature", "0.8", "--seed", "5", "--speculative-config", NGRAM)[0] == sampled


def serve_outputs(relay_bin, *args):
    # A small KV pool and token budget: chunked prefill and preemption happen; the shared prefix of
    # the first two requests hits the prefix cache.
    server = RelayServer(relay_bin, "--num-kv-blocks", 40, "--max-num-batched-tokens", 48, "--max-num-seqs", 4, *args)
    server.wait_ready()
    try:
        def one(i):
            body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)] * (1 + i % 2), "max_tokens": 40,
                    "ignore_eos": True, "temperature": 0 if i < 4 else 0.7, "seed": i}
            r = requests.post(server.base + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with cf.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(one, range(8)))
        return texts, server.metrics()
    finally:
        assert server.stop() == 0


def test_server_with_ngram_drafts_answers_the_same(relay_bin):
    plain, plain_metrics = serve_outputs(relay_bin)
    spec, metrics = serve_outputs(relay_bin, "--speculative-config", NGRAM)
    assert spec == plain
    label = f'{{model_name="{MODEL}"}}'
    assert plain_metrics["relay:spec_decode_num_drafts_total" + label] == 0
    drafts = metrics["relay:spec_decode_num_draft_tokens_total" + label]
    accepted = metrics["relay:spec_decode_num_accepted_tokens_total" + label]
    assert metrics["relay:spec_decode_num_drafts_total" + label] > 0 and 0 < accepted <= drafts
    per_pos = [metrics[f'relay:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{MODEL}",position="{p}"}}']
               for p in range(4)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert metrics["relay:num_preemptions_total" + label] > 0 or metrics["relay:prefix_cache_hits_total" + label] > 0
    # Per-request draft lengths (min_draft_acceptance) change how many drafts are verified, never the text.
    adaptive, _ = serve_outputs(relay_bin, "--speculative-config",
                                json.dumps({**json.loads(NGRAM), "min_draft_acceptance": 0.5}))
    assert adaptive == plain


def test_bad_configurations_fail_at_start(relay_bin):
    missing = FIXTURES / "models" / "no-such-head"
    for config, message in [('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
                            ('{"method": "ngram", "num_speculative_tokens": 99}', "'num_speculative_tokens' must be between"),
                            ('{"method": "mtp", "num_speculative_tokens": 17}', "'num_speculative_tokens' must be between"),
                            # The demo model (Qwen3-MoE) ships no MTP head: the error points at "model".
                            ('{"method": "mtp", "num_speculative_tokens": 1}', 'has no tensor mtp.fc.weight'),
                            ('{"method": "mtp", "num_speculative_tokens": 1}', '"model": DIR'),
                            (json.dumps({"method": "mtp", "num_speculative_tokens": 1, "model": str(missing)}),
                             f"the MTP head directory {missing} (\"model\" in the speculative config) does not exist"),
                            ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "'model' is an mtp option"),
                            ('{"method": "ngram", "num_speculative_tokens": 2, "min_draft_acceptance": 1.5}',
                             "'min_draft_acceptance' must be a number between 0 and 1"),
                            ("not json", "not valid JSON")]:
        r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--speculative-config", config],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and message in r.stderr, (config, r.stderr)
    r = subprocess.run([str(relay_bin), "serve", "--role", "router", "--port", "0", "--speculative-config", NGRAM],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "belongs on the decode workers" in r.stderr
    r = subprocess.run([str(relay_bin), "serve", "--role", "decode", "--port", "0", "--threads", "1",
                        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'],
                       capture_output=True, text=True, timeout=120)
    # A decode worker may draft with MTP (the prefill worker hands the head's K/V over), given a head.
    assert r.returncode != 0 and "MTP was requested but the checkpoint" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """The qwen3-moe fixture with the demo model's tokenizer (its ids are below 512)."""
    d = tmp_path_factory.mktemp("qwen3-moe") / "qwen3-moe"
    shutil.copytree(FIXTURES / "models" / "qwen3-moe", d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "relay-demo-moe" / f, d / f)
    return d


def test_generate_with_a_separate_mtp_head_writes_the_same_text(relay_bin, qwen3_moe_dir):
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 3, "model": str(FIXTURES / "models" / "qwen3-moe-mtp")})
    def run(*args):
        r = subprocess.run([str(relay_bin), "generate", "--model", str(qwen3_moe_dir), "--prompt", "12, 34. 5+6 = 7;",
                            "--max-tokens", "32", "--ignore-eos", "--threads", "2", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr
    plain, _ = run()
    spec, log = run("--speculative-config", mtp)
    assert spec == plain and plain.strip()
    assert "speculative decoding (mtp k=3 head " in log and "drafts accepted" in log
