"""`relay bench` on a machine without a GPU: the command line only. The model mode takes relay
generate's --tp / --ep / --dp / --gpus, and every layout that cannot work is refused with a message
naming the flag (or the config field that does not divide) before CUDA starts — so these checks read
the same on the CUDA build CI makes (nvcc present, no GPU) and on a build without CUDA, where a valid
command line would instead end with "needs the CUDA build" (exit code 2)."""
import subprocess

import pytest

from conftest import DEMO_MODEL


def bench(relay_bin, *args):
    return subprocess.run([str(relay_bin), "bench", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_help_lists_the_sharding_flags(relay_bin):
    r = bench(relay_bin, "--help")
    assert r.returncode == 0, r.stderr
    for flag in ["--tp", "--ep", "--dp", "--gpus"]:
        assert flag in r.stdout, flag


MODEL = ["--mode", "model", "--model", DEMO_MODEL]
REFUSED = [
    # The layouts relay generate refuses, with its messages (demo model: 4 heads, 16 experts).
    (MODEL + ["--tp", 3], "--tp 3 does not divide num_attention_heads"),
    (MODEL + ["--tp", 2, "--ep", 4], "--ep 4 must be 1"),
    (MODEL + ["--tp", 2, "--dp", 2], "--tp 2 with --dp 2 is not supported"),
    (MODEL + ["--dp", 3, "--ep", 3], "--ep 3 does not divide num_experts"),
    (MODEL + ["--tp", 2, "--gpus", "0"], "--gpus lists 1 devices for 2 ranks"),
    (MODEL + ["--dp", 2, "--gpus", "0,x"], "--gpus: 'x' in '0,x' is not a device index"),
    # Flags on a mode they do not apply to.
    (["--mode", "kernels", "--tp", 2], "--tp 2: --tp, --ep, --dp and --gpus shard the model mode"),
    (["--mode", "all", "--model", DEMO_MODEL, "--gpus", "0,0"], "--gpus 0,0: --tp, --ep, --dp and --gpus"),
    (["--mode", "collectives", "--dp", 2, "--ep", 2], "its GPU count is --ranks"),
    (["--mode", "accuracy", "--model", DEMO_MODEL, "--ep", 2], "--mode accuracy is not sharded"),
    (MODEL + ["--ranks", 2], "--ranks 2 is the collectives mode's GPU count"),
    (["--mode", "model", "--tp", 2], "bench --mode model needs --model DIR"),
    # The step capacity: the model mode's only, and at least every prompt and batch asked for.
    (["--mode", "kernels", "--max-num-batched-tokens", 1024], "--max-num-batched-tokens sizes the model mode"),
    (MODEL + ["--max-num-batched-tokens", 1024, "--prefill-lengths", "512,4096"],
     "--prefill-lengths 4096 exceeds --max-num-batched-tokens 1024"),
    (MODEL + ["--max-num-batched-tokens", 32, "--decode-batches", "8,64"],
     "--decode-batches 64 exceeds --max-num-batched-tokens 32"),
]


@pytest.mark.parametrize("args,needle", REFUSED, ids=[n for _, n in REFUSED])
def test_layouts_that_cannot_work_are_refused_naming_the_flag(relay_bin, args, needle):
    r = bench(relay_bin, *args)
    assert r.returncode != 0 and "relay: error:" in r.stderr and needle in r.stderr, (args, r.stderr)
    assert r.stdout == ""  # refused before any measurement (no ceilings line)


def test_cli_parser_refuses_non_positive_ranks(relay_bin):
    for flag in ["--tp", "--ep", "--dp"]:
        r = bench(relay_bin, *MODEL, flag, 0)
        assert r.returncode != 0 and flag in r.stderr, (flag, r.stderr)
