"""Multi-node workers on the CPU backend (--nnodes / --node-rank / --dist-init): the ranks of one
worker in several processes, as on several hosts. `relay generate` and `relay serve` give the
one-process text; a follower that disappears makes node 0 fail requests with the reason instead of
hanging or crashing; nodes started with different flags, and layouts no node count can split, are
refused with a message naming the flag."""
import concurrent.futures as cf
import contextlib
import json
import subprocess

import openai
import pytest
import requests

from conftest import ROOT
from relay_server import RelayServer, completion_text, free_port

PROMPT = "def merge_sort(values):"


def node_args(nnodes, rank, address):
    return ["--nnodes", nnodes, "--node-rank", rank, "--dist-init", address]


def start_followers(relay_bin, command, nnodes, address, *args):
    """Nodes 1..nnodes-1 of a worker, started with node 0's flags."""
    return [subprocess.Popen([str(relay_bin), command, "--threads", "1", *map(str, args),
                              *map(str, node_args(nnodes, n, address))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for n in range(1, nnodes)]


def generate_cmd(relay_bin, *args):
    return [str(relay_bin), "generate", "--threads", "1", "--prompt", PROMPT, "--max-tokens", "24",
            "--ignore-eos", *map(str, args)]


@pytest.fixture(scope="module")
def one_process_text(relay_bin):
    r = subprocess.run(generate_cmd(relay_bin), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("layout,nnodes", [(["--tp", 2], 2), (["--dp", 2, "--ep", 2], 2),
                                           (["--tp", 4, "--ep", 4], 2)],
                         ids=["tp2_2nodes", "dp2ep2_2nodes", "tp4ep4_2nodes"])
def test_generate_across_processes_equals_one_process(relay_bin, one_process_text, layout, nnodes):
    address = f"127.0.0.1:{free_port()}"
    followers = start_followers(relay_bin, "generate", nnodes, address, "--prompt", PROMPT,
                                "--max-tokens", 24, "--ignore-eos", *layout)
    leader = subprocess.run(generate_cmd(relay_bin, *layout, *node_args(nnodes, 0, address)),
                            capture_output=True, text=True, timeout=300)
    assert leader.returncode == 0, leader.stderr
    assert leader.stdout == one_process_text
    for f in followers:
        out, err = f.communicate(timeout=60)
        assert f.returncode == 0, err
        assert "following node 0" in err and "shut the worker down" in err


@contextlib.contextmanager
def two_node_server(relay_bin, *args):
    """`relay serve` as node 0 of two (a follower node with the same flags beside it), ready:
    yields (node 0's server, the follower's process)."""
    address = f"127.0.0.1:{free_port()}"
    [follower] = start_followers(relay_bin, "serve", 2, address, *args)
    leader = RelayServer(relay_bin, *args, *node_args(2, 0, address))
    try:
        leader.wait_ready()
        yield leader, follower
    finally:
        if follower.poll() is None:
            follower.kill()
        assert leader.stop() == 0, leader.log_text()


def complete_together(server, complete, prompts):
    """Every prompt at once (continuous batching puts them in the same steps)."""
    client = server.client()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p), prompts))


def test_server_across_processes_and_a_lost_follower(relay_bin):
    prompts = [f"def task_{i}(items, n={i}):" for i in range(6)]

    def complete(client, prompt):
        return completion_text(client, prompt, max_tokens=12, extra_body={"ignore_eos": True})

    one = RelayServer(relay_bin)
    one.wait_ready()
    try:
        want = [complete(one.client(), p) for p in prompts]
    finally:
        assert one.stop() == 0

    with two_node_server(relay_bin, "--dp", 2, "--ep", 2) as (leader, follower):
        assert complete_together(leader, complete, prompts) == want

        # Node 1 vanishes: its ranks (half the experts, half the KV) are gone. Node 0 fails the
        # requests with the reason and keeps answering; it does not hang or crash.
        follower.kill()
        follower.wait(timeout=30)
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as err:
                complete(leader.client(), prompts[0])
            assert "lost a node" in str(err.value), str(err.value)
        health = requests.get(leader.base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unusable", health.text
        assert "lost a node" in health.json()["reason"]
        assert leader.proc.poll() is None


def test_mtp_server_across_processes_equals_one_process(relay_bin):
    """The demo hybrid served with MTP drafts, DP 2 + EP 2 ranks in two processes, concurrent
    requests with prompts in chunks of at most 24 tokens: each node drafts for the sequences it
    samples (node 1's from the tokens after its own chunks), so every text is the one-process one,
    and so are the drafts: the same number accepted at each position."""
    model = ["--model", ROOT / "models" / "relay-demo-hybrid"]
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    args = [*model, *spec, "--dp", 2, "--ep", 2, "--max-num-batched-tokens", 24, "--max-num-seqs", 8]
    prompts = [f"def task_{i}(items, n={i}):\n    \"\"\"Sort the items, keep the first n, and return "
               f"them as a list of {i} values.\"\"\"\n" for i in range(6)]

    def complete(client, prompt):
        r = client.completions.create(model="relay-demo-hybrid", prompt=prompt, max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r.choices[0].text

    def accepted(server):
        metrics = requests.get(server.base + "/metrics", timeout=10).text
        return sorted(line for line in metrics.splitlines()
                      if line.startswith("relay:spec_decode_num_accepted_tokens"))

    one = RelayServer(relay_bin, *args)
    one.wait_ready()
    try:
        want = [complete(one.client(), p) for p in prompts]
        want_accepted = accepted(one)
    finally:
        assert one.stop() == 0
    assert float(want_accepted[-1].split()[-1]) > 0, want_accepted

    with two_node_server(relay_bin, *args) as (leader, _):
        assert complete_together(leader, complete, prompts) == want
        assert accepted(leader) == want_accepted


def test_nodes_with_different_flags_are_refused(relay_bin):
    address = f"127.0.0.1:{free_port()}"
    [follower] = start_followers(relay_bin, "generate", 2, address, "--prompt", PROMPT,
                                 "--tp", 2, "--block-size", 32)
    leader = subprocess.run(generate_cmd(relay_bin, "--tp", 2, *node_args(2, 0, address)),
                            capture_output=True, text=True, timeout=120)
    _, follower_err = follower.communicate(timeout=60)
    for rc, err in [(leader.returncode, leader.stderr), (follower.returncode, follower_err)]:
        assert rc != 0 and "relay: error:" in err and "node 1 was started for" in err, err
        assert "--block-size 32" in err, err


@pytest.mark.parametrize("args,needle", [
    (["--tp", 2, "--nnodes", 4, "--dist-init", "127.0.0.1:1"], "evenly"),
    (["--tp", 2, "--nnodes", 2], "--dist-init"),
    (["--tp", 2, "--nnodes", 2, "--node-rank", 2, "--dist-init", "127.0.0.1:1"], "--node-rank"),
    (["--dist-init", "127.0.0.1:1"], "--nnodes 2"),
    (["--tp", 2, "--nnodes", 2, "--dist-init", "127.0.0.1:1", "--device", "cuda"], "cpu device"),
])
def test_bad_node_flags_name_the_flag(relay_bin, args, needle):
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", *map(str, args)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "relay: error:" in r.stderr and needle in r.stderr, r.stderr


def test_disaggregated_roles_refuse_several_nodes(relay_bin):
    r = subprocess.run([str(relay_bin), "serve", "--role", "prefill", "--tp", "2", "--nnodes", "2",
                        "--dist-init", "127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--role prefill with --nnodes 2" in r.stderr, r.stderr
    r = subprocess.run([str(relay_bin), "serve", "--role", "router", "--nnodes", "2", "--dist-init", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "the router runs no ranks" in r.stderr, r.stderr


def test_score_across_processes_is_bit_identical_to_one_process(relay_bin, tmp_path):
    """`relay score` (every position's logits) with the TP 2 + EP 2 ranks in two processes gives the
    one-process TP 2 + EP 2 bytes: the TCP collectives add in the same rank order."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7], list(range(100, 140))]))
    layout = ["--tp", 2, "--ep", 2, "--chunk-tokens", 16]

    def score_cmd(out, *extra):
        return [str(relay_bin), "score", "--threads", "1", "--prompts", str(prompts), "--out", str(out),
                *map(str, layout), *map(str, extra)]

    one = subprocess.run(score_cmd(tmp_path / "one.f32"), capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    address = f"127.0.0.1:{free_port()}"
    [follower] = start_followers(relay_bin, "score", 2, address, "--prompts", prompts, "--out",
                                 tmp_path / "unused.f32", *layout)
    leader = subprocess.run(score_cmd(tmp_path / "two.f32", *node_args(2, 0, address)), capture_output=True,
                            text=True, timeout=300)
    assert leader.returncode == 0, leader.stderr
    _, err = follower.communicate(timeout=60)
    assert follower.returncode == 0, err
    assert (tmp_path / "two.f32").read_bytes() == (tmp_path / "one.f32").read_bytes()
    assert not (tmp_path / "unused.f32").exists()


@pytest.mark.parametrize("spec", ['{"method": "ngram", "num_speculative_tokens": 3}',
                                  '{"method": "mtp", "num_speculative_tokens": 2}'],
                         ids=["ngram", "mtp"])
def test_hybrid_with_drafts_across_processes_equals_one_process(relay_bin, spec):
    """The demo hybrid (Gated DeltaNet layers) with n-gram or MTP drafts, DP 2 + EP 2 ranks in two
    processes: each node rolls back the recurrent states of the sequences it samples, and with MTP
    drafts for them (the head's MoE exchanging rows across the processes) and hands its drafts to
    node 0, so the text, and the drafts accepted, are the one-process ones."""
    model = ["--model", str(ROOT / "models" / "relay-demo-hybrid")]
    spec = ["--speculative-config", spec]
    layout = ["--dp", 2, "--ep", 2]
    one = subprocess.run(generate_cmd(relay_bin, *model, *spec, *layout), capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    address = f"127.0.0.1:{free_port()}"
    followers = start_followers(relay_bin, "generate", 2, address, "--prompt", PROMPT,
                                "--max-tokens", 24, "--ignore-eos", *model, *spec, *layout)
    leader = subprocess.run(generate_cmd(relay_bin, *model, *spec, *layout, *node_args(2, 0, address)),
                            capture_output=True, text=True, timeout=300)
    assert leader.returncode == 0, leader.stderr
    assert leader.stdout == one.stdout
    accepted = [line for line in leader.stderr.splitlines() if "drafts accepted" in line]
    assert accepted and accepted == [line for line in one.stderr.splitlines()
                                     if "drafts accepted" in line]
    for f in followers:
        _, err = f.communicate(timeout=60)
        assert f.returncode == 0, err
