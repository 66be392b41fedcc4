"""Sharded CPU ranks end to end: `relay generate` and `relay serve` with --tp / --ep / --dp produce the
one-rank text, a DP server under concurrent load and a tight KV pool (preemption) loses nothing, and
layouts the model cannot divide fail with a message naming the field."""
import concurrent.futures as cf
import subprocess

import pytest

from relay_server import RelayServer, completion_text

PROMPT = "def merge_sort(values):"
LAYOUTS = [["--tp", 2], ["--tp", 4], ["--tp", 2, "--ep", 2], ["--tp", 4, "--ep", 4], ["--dp", 2],
           ["--dp", 2, "--ep", 2], ["--dp", 4, "--ep", 4]]


def generate(relay_bin, *args):
    r = subprocess.run([str(relay_bin), "generate", "--threads", "2", "--prompt", PROMPT, "--max-tokens", "32",
                        "--ignore-eos", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def one_rank_text(relay_bin):
    return generate(relay_bin)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "".join(map(str, l)).replace("--", "_"))
def test_generate_sharded_equals_one_rank(relay_bin, one_rank_text, layout):
    assert generate(relay_bin, *layout) == one_rank_text


def test_unsupported_layouts_name_the_field(relay_bin):
    for args, needle in [(["--tp", 3], "num_attention_heads"), (["--tp", 2, "--ep", 4], "--ep"),
                         (["--tp", 2, "--dp", 2], "--dp"), (["--dp", 3, "--ep", 3], "num_experts")]:
        r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", *map(str, args)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and "relay: error:" in r.stderr and needle in r.stderr, (args, r.stderr)


def test_dp_ep_server_under_load_and_preemption_equals_one_rank(relay_bin):
    prompts = [f"def task_{i}(items, n={i}):" for i in range(12)]

    def complete(client, prompt):
        return completion_text(client, prompt, max_tokens=20, extra_body={"ignore_eos": True})

    one = RelayServer(relay_bin)
    one.wait_ready()
    try:
        client = one.client()
        want = [complete(client, p) for p in prompts]
    finally:
        assert one.stop() == 0
    # 2 DP ranks x 6 blocks of 16 tokens: a dozen concurrent requests of ~30 tokens cannot all fit,
    # so the scheduler queues and preempts inside each rank's partition.
    dp = RelayServer(relay_bin, "--dp", 2, "--ep", 2, "--num-kv-blocks", 6, "--max-num-seqs", 12)
    dp.wait_ready()
    try:
        client = dp.client()
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(client, p), prompts))
        assert got == want
        dp.wait_idle()
        assert dp.metric("relay:kv_cache_usage_perc") == 0  # every block back in both partitions
        assert dp.metric("relay:num_preemptions_total") > 0
        assert dp.metric("relay:request_success_total", finished_reason="length") == len(prompts)
    finally:
        assert dp.stop() == 0
