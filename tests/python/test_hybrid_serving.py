"""Serving a hybrid model (Qwen3.5-MoE: Gated DeltaNet + gated attention) end to end: `relay serve` on the
tiny fixture checkpoint answers /v1/completions with transformers' greedy tokens for every fixture prompt, sent
together (continuous batching, chunked prefill, fewer state slots than requests), with and without n-gram
drafts and with drafts from the checkpoint's own MTP head (issue 26: its spec-decode counters in /metrics), and
on sharded ranks (TP, TP + EP, DP + EP);
`relay generate` writes the same text with MTP drafts as without, greedy and seeded; the recurrent-state slots
show in /metrics and are all returned; prefix caching (recurrent-state snapshots at block boundaries) gives
the tokens and logprobs of --no-prefix-caching with the hits in usage and /metrics; a disaggregated prefill
worker hands the prompt's recurrent state to the decode worker with its KV. The fixtures carry no
tokenizer, so the test serves a copy with the demo model's (ids below 512 only)."""
import concurrent.futures as cf
import json
import shutil
import subprocess
import time

import pytest
import requests

from conftest import FIXTURES, ROOT
from relay_server import RelayServer

NAME = "qwen3_5-moe"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
TEXT_PROMPT = "12, 34. 5+6 = 7; 8 - 9!"  # the demo tokenizer's ids for it are all below 512


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid") / NAME
    shutil.copytree(FIXTURES / "models" / NAME, d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "relay-demo-moe" / f, d / f)
    return d


def expected():
    j = json.loads((FIXTURES / "models" / NAME / "expected.json").read_text())
    return j["prompts"], j["greedy"]


def complete_greedy(base, i):
    """The token ids of fixture prompt i's greedy completion from the server at `base`."""
    prompts, greedy = expected()
    body = {"model": NAME, "prompt": prompts[i], "max_tokens": len(greedy[i]), "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    r = requests.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def serve_greedy(relay_bin, hybrid_dir, *args):
    prompts, greedy = expected()
    # 2 running sequences at most (--max-num-seqs 2) and a 16-token budget: the 64- and 70-token
    # prompts are prefilled in chunks while the others decode.
    server = RelayServer(relay_bin, "--model", hybrid_dir, "--served-model-name", NAME, "--max-num-seqs", 2,
                         "--max-num-batched-tokens", 16, "--block-size", 4, *args)
    server.wait_ready()
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda i: complete_greedy(server.base, i), range(len(prompts))))
        metrics = server.wait_idle(model=NAME)
        log = server.log_text()
    finally:
        assert server.stop() == 0
    assert got == greedy
    return metrics, log


def test_hybrid_model_serves_the_reference_tokens(relay_bin, hybrid_dir):
    metrics, log = serve_greedy(relay_bin, hybrid_dir)
    label = f'{{model_name="{NAME}"}}'
    assert metrics["relay:state_slot_usage_perc" + label] == 0
    assert metrics["relay:prefix_cache_hits_total" + label] == 0
    assert "2 recurrent-state slots" in log  # one per running sequence


@pytest.mark.parametrize("layout,spec", [(["--tp", 2], NGRAM), (["--tp", 2, "--ep", 2], NGRAM),
                                         (["--dp", 2, "--ep", 2], NGRAM), (["--tp", 2], MTP),
                                         (["--dp", 2, "--ep", 2], MTP)],
                         ids=["tp2-ngram", "tp2-ep2-ngram", "dp2-ep2-ngram", "tp2-mtp", "dp2-ep2-mtp"])
def test_hybrid_model_on_sharded_ranks_serves_the_reference_tokens(relay_bin, hybrid_dir, layout, spec):
    """TP splits the Gated DeltaNet heads, their recurrent state and the shared expert; DP ranks hold
    their own sequences' states; drafts (n-gram, or the MTP head's, drafting on every DP rank) roll
    the sharded states back."""
    metrics, _ = serve_greedy(relay_bin, hybrid_dir, *layout, "--speculative-config", spec)
    label = f'{{model_name="{NAME}"}}'
    assert metrics["relay:state_slot_usage_perc" + label] == 0
    assert metrics["relay:spec_decode_num_draft_tokens_total" + label] > 0


def test_hybrid_model_with_ngram_drafts(relay_bin, hybrid_dir):
    metrics, log = serve_greedy(relay_bin, hybrid_dir, "--speculative-config", NGRAM)
    assert "8 recurrent-state slots" in log  # each sequence: its state and 3 snapshots
    assert metrics[f'relay:spec_decode_num_draft_tokens_total{{model_name="{NAME}"}}'] > 0


def test_hybrid_model_with_mtp_drafts(relay_bin, hybrid_dir):
    metrics, log = serve_greedy(relay_bin, hybrid_dir, "--speculative-config", MTP)
    assert "speculative decoding mtp k=2" in log
    assert "6 recurrent-state slots" in log  # each sequence: its state and 2 snapshots
    label = f'{{model_name="{NAME}"}}'
    num_drafts = metrics["relay:spec_decode_num_drafts_total" + label]
    drafts = metrics["relay:spec_decode_num_draft_tokens_total" + label]
    accepted = metrics["relay:spec_decode_num_accepted_tokens_total" + label]
    # Every decode after the first token carries the head's drafts (the random head's are rarely right).
    assert num_drafts > 0 and num_drafts <= drafts <= 2 * num_drafts and 0 <= accepted <= drafts
    per_pos = [metrics[f'relay:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{NAME}",position="{p}"}}']
               for p in range(2)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    assert metrics["relay:state_slot_usage_perc" + label] == 0


def test_generate_with_mtp_drafts_writes_the_same_text(relay_bin, hybrid_dir):
    def generate(*args):
        r = subprocess.run([str(relay_bin), "generate", "--model", str(hybrid_dir), "--prompt", TEXT_PROMPT,
                            "--max-tokens", "24", "--ignore-eos", "--threads", "2", "--block-size", "4", *args],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr
    plain, _ = generate()
    spec, log = generate("--speculative-config", MTP)
    assert spec == plain and plain.strip()
    assert "speculative decoding (mtp k=2):" in log and "drafts accepted" in log
    sampled, _ = generate("--temperature", "0.8", "--seed", "3")
    assert generate("--temperature", "0.8", "--seed", "3", "--speculative-config", MTP)[0] == sampled


@pytest.mark.parametrize("spec", [(), ("--speculative-config", MTP)], ids=["plain", "mtp"])
def test_disaggregated_prefill_hands_over_the_recurrent_state(relay_bin, hybrid_dir, spec):
    """A router, a prefill worker at TP 2 and a decode worker at DP 2 + EP 2: the prompt's KV and its
    recurrent state (the Gated DeltaNet heads split over the prefill's TP ranks, whole on the decode's
    DP rank) travel over UCX, and the decode worker continues with transformers' greedy tokens. With
    the MTP head on both roles its K/V of the prompt travels too and the decode worker drafts."""
    prompts, greedy = expected()
    router = RelayServer(relay_bin, "--role", "router", "--model", hybrid_dir, "--served-model-name", NAME,
                         "--heartbeat-interval", 0.2)
    router.wait_ready(path="/version")
    common = ("--model", hybrid_dir, "--served-model-name", NAME, "--block-size", 4, "--router",
              f"127.0.0.1:{router.port}", "--heartbeat-interval", 0.2, *spec)
    prefill = RelayServer(relay_bin, "--role", "prefill", *common, "--tp", 2)
    decode = RelayServer(relay_bin, "--role", "decode", *common, "--dp", 2, "--ep", 2)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        deadline = time.time() + 60
        while requests.get(router.base + "/health", timeout=5).status_code != 200:
            assert time.time() < deadline, "the router's workers did not come up"
            time.sleep(0.1)
        with cf.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda i: complete_greedy(router.base, i), range(len(prompts)))) == greedy
        label = f'{{model_name="{NAME}"}}'
        for w in (prefill, decode):  # every page and state slot went back
            metrics = w.wait_idle(model=NAME)
            assert metrics["relay:kv_cache_usage_perc" + label] == 0
            assert metrics["relay:state_slot_usage_perc" + label] == 0
        assert "KV hand-off" in prefill.log_text()
        if spec:
            assert metrics["relay:spec_decode_num_draft_tokens_total" + label] > 0  # the decode worker's
    finally:
        for s in (router, prefill, decode):
            if s.proc.poll() is None:
                assert s.stop() == 0, s.log_text()


def serve_shared_prefixes(relay_bin, hybrid_dir, *args, snapshots=16):
    """Prompts sharing prefixes of the 70-token fixture prompt P, one after the other: P, P's first 30 tokens then
    others (diverging mid-block), P again, P's first 30 then yet others. Returns per prompt the sampled tokens
    with their logprobs and top logprobs, the cached tokens in usage, the /metrics sample and the log."""
    prompts, _ = expected()
    p, q = prompts[3], prompts[2]
    load = [p, p[:30] + q[:20], p, p[:30] + q[5:25]]
    server = RelayServer(relay_bin, "--model", hybrid_dir, "--served-model-name", NAME, "--max-num-seqs", 2,
                         "--max-num-batched-tokens", 16, "--block-size", 4, "--num-state-snapshots", snapshots, *args)
    server.wait_ready()
    try:
        outputs, cached = [], []
        for prompt in load:
            body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "logprobs": 3, "return_tokens_as_token_ids": True}
            r = requests.post(server.base + "/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            outputs.append((lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics = server.wait_idle(model=NAME)
        log = server.log_text()
    finally:
        assert server.stop() == 0
    return outputs, cached, metrics, log


def test_hybrid_prefix_caching_gives_the_outputs_of_no_caching(relay_bin, hybrid_dir):
    on, cached, metrics, log = serve_shared_prefixes(relay_bin, hybrid_dir)
    off, cached_off, metrics_off, log_off = serve_shared_prefixes(relay_bin, hybrid_dir, "--no-prefix-caching")
    assert on == off  # tokens, logprobs and top logprobs, exactly
    # Chunks of 16 end on block boundaries: P leaves snapshots at 16, 32, 48, 64 and 68; the second prompt hits
    # the 16 of the 28 cached tokens it shares and leaves a snapshot at 28, which the fourth hits; P again hits 68.
    assert cached == [0, 16, 68, 28]
    assert cached_off == [0, 0, 0, 0]
    label = f'{{model_name="{NAME}"}}'
    assert metrics["relay:prefix_cache_hits_total" + label] == sum(cached)
    assert metrics_off["relay:prefix_cache_hits_total" + label] == 0
    assert metrics["relay:state_slot_usage_perc" + label] == 0
    assert 0 < metrics["relay:state_snapshots_cached" + label] <= 16  # --num-state-snapshots 16
    assert metrics_off["relay:state_snapshots_cached" + label] == 0
    assert "recurrent-state snapshots at block boundaries" in log and "prefix caching on" in log
    assert "prefix caching off (--no-prefix-caching)" in log_off
    _, cached_none, _, log_none = serve_shared_prefixes(relay_bin, hybrid_dir, snapshots=0)
    assert cached_none == [0, 0, 0, 0]
    assert "no recurrent-state snapshots (--num-state-snapshots 0)" in log_none
