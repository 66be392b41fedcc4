"""`relay bench` on a machine without a GPU: the command line only. The model mode takes relay
generate's --tp / --ep / --dp / --gpus, and every layout that cannot work is refused with a message
naming the flag (or the config field that does not divide) before CUDA starts — so these checks read
the same on the CUDA build CI makes (nvcc present, no GPU) and on a build without CUDA, where a valid
command line would instead end with "needs the CUDA build" (exit code 2)."""
import subprocess
from pathlib import Path

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


# --device cpu: the model mode's decode through the engine, with speculative decoding's acceptance.
import json

MTP = '{"method": "mtp", "num_speculative_tokens": 2}'
CPU = ["--mode", "model", "--device", "cpu", "--threads", 2]


@pytest.fixture(scope="module")
def tiny_mtp_model(relay_bin, tmp_path_factory):
    """A random Qwen3.5-MoE with its MTP head (make-model's tiny preset)."""
    out = tmp_path_factory.mktemp("bench") / "tiny-qwen3.5-moe"
    r = subprocess.run([str(relay_bin), "make-model", "--preset", "tiny-qwen3.5-moe", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def lines_of(r):
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[0]["mode"] == "load" and lines[0]["device"] == "cpu"
    return lines[0], [l for l in lines[1:] if l["mode"] == "decode"]


def test_cpu_bench_reports_acceptance_beside_decode_rate(relay_bin, tiny_mtp_model):
    load, decode = lines_of(bench(relay_bin, *CPU, "--model", tiny_mtp_model, "--decode-batches", "1,3",
                                  "--decode-contexts", "20,40", "--decode-tokens", 12,
                                  "--speculative-config", MTP))
    assert load["speculative"] == "mtp k=2" and load["forced_acceptance"] is None
    assert [(l["batch"], l["context"]) for l in decode] == [(1, 20), (1, 40), (3, 20), (3, 40)]
    for l in decode:
        assert l["tok_per_s"] > 0 and l["tokens"] == 12 * l["batch"]
        # k = 2 drafts a decode, fewer where max_tokens leaves less room.
        assert l["num_drafts"] > 0 and l["num_drafts"] <= l["num_draft_tokens"] <= 2 * l["num_drafts"]
        assert l["acceptance_rate"] == l["num_accepted_tokens"] / l["num_draft_tokens"]
        assert l["mean_acceptance_length"] == 1 + l["num_accepted_tokens"] / l["num_drafts"]
        assert sum(l["accepted_per_position"]) == l["num_accepted_tokens"]
    # Without speculation: the decode rate alone.
    _, plain = lines_of(bench(relay_bin, *CPU, "--model", tiny_mtp_model, "--decode-batches", 2,
                              "--decode-contexts", 20, "--decode-tokens", 8))
    assert plain[0]["speculative"] == "off" and "acceptance_rate" not in plain[0]
    # --mode engine is the same measurement (the cpu device's model mode is the engine mode).
    _, engine = lines_of(bench(relay_bin, "--mode", "engine", "--device", "cpu", "--threads", 2,
                               "--model", tiny_mtp_model, "--decode-batches", 2,
                               "--decode-contexts", 20, "--decode-tokens", 8))
    assert engine[0]["device"] == "cpu" and engine[0]["tokens"] == plain[0]["tokens"]
    # The cpu device has no first-step costs to keep out (the cuda device runs each shape once
    # untimed first).
    assert engine[0]["warmup_runs"] == 0


def test_cpu_bench_forced_acceptance(relay_bin, tiny_mtp_model):
    """--spec-forced-acceptance P accepts each draft with probability P whatever the target sampled:
    1 accepts every draft (each decode commits 1 + k tokens), 0 none."""
    args = [*CPU, "--model", tiny_mtp_model, "--decode-batches", 2, "--decode-contexts", 24,
            "--speculative-config", MTP]
    _, all_in = lines_of(bench(relay_bin, *args, "--decode-tokens", 30, "--spec-forced-acceptance", 1))
    assert all_in[0]["forced_acceptance"] == 1
    assert all_in[0]["acceptance_rate"] == 1.0 and all_in[0]["mean_acceptance_length"] == 3.0
    _, none = lines_of(bench(relay_bin, *args, "--decode-tokens", 30, "--spec-forced-acceptance", 0))
    assert none[0]["num_accepted_tokens"] == 0 and none[0]["mean_acceptance_length"] == 1.0
    _, most = lines_of(bench(relay_bin, *args, "--decode-tokens", 200, "--spec-forced-acceptance", 0.8))
    assert 0.65 < most[0]["acceptance_rate"] < 0.95, most[0]
    # Fewer steps for the same tokens than without drafts accepted.
    assert all_in[0]["steps"] < none[0]["steps"]


def test_cpu_bench_dummy_release_shape_at_forced_acceptance(relay_bin, tmp_path):
    """Issue 26's measurement on Qwen3.5-35B-A3B's shapes (4 layers, experts cut to 16 for CI's memory)
    from config.json alone: its dummy MTP head drafts and 0.8 of them are accepted."""
    out = tmp_path / "q35"
    r = subprocess.run([str(relay_bin), "make-model", "--preset", "qwen3.5-35b-a3b", "--layers", "4",
                        "--config-only", "--config-patch", '{"text_config": {"num_experts": 16}}',
                        "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    load, decode = lines_of(bench(relay_bin, *CPU, "--model", out, "--load-format", "dummy",
                                  "--decode-batches", 1, "--decode-contexts", 16, "--decode-tokens", 6,
                                  "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
                                  "--spec-forced-acceptance", 0.8))
    assert load["architecture"] == "Qwen3_5MoeForConditionalGeneration" and load["layers"] == 4
    assert decode[0]["num_drafts"] > 0 and decode[0]["forced_acceptance"] == 0.8


def test_cpu_bench_ngram_on_the_demo_model(relay_bin):
    """The trained demo model falls into repeating itself on the bench's prompts, which the n-gram
    proposer then copies: real (verified) acceptance."""
    _, decode = lines_of(bench(relay_bin, *CPU, "--model", DEMO_MODEL, "--decode-batches", 1,
                               "--decode-contexts", 48, "--decode-tokens", 64, "--speculative-config",
                               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'))
    assert decode[0]["speculative"] == "ngram k=3 lookup 1..5"
    assert decode[0]["num_drafts"] > 0 and 0 < decode[0]["acceptance_rate"] <= 1
    assert decode[0]["mean_acceptance_length"] > 1


CODE_EDIT = Path(__file__).resolve().parents[2] / "bench" / "prompts" / "code-edit.py"


def test_cpu_bench_prompt_file(relay_bin, tmp_path):
    """--prompt-file: every request's prompt is the file's text, tokenized (the context it reports);
    n-gram drafting then copies from real text."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    _, decode = lines_of(bench(relay_bin, *CPU, "--model", DEMO_MODEL, "--decode-batches", "1,2",
                               "--decode-tokens", 32, "--prompt-file", CODE_EDIT,
                               "--speculative-config", ngram))
    assert [d["batch"] for d in decode] == [1, 2]
    assert decode[0]["context"] == decode[1]["context"] > 200  # about 240 tokens of Python
    assert decode[0]["num_drafts"] > 0
    absent = tmp_path / "absent.txt"
    for args, needle in [(["--prompt-file", absent], f"{absent}: cannot open"),
                         (["--prompt-file", tmp_path / "empty.txt"], "no tokens (empty file)"),
                         (["--prompt-file", CODE_EDIT, "--decode-contexts", 64], "drop --decode-contexts")]:
        (tmp_path / "empty.txt").write_text("")
        r = bench(relay_bin, *CPU, "--model", DEMO_MODEL, *args)
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
        assert r.stdout == ""
    r = bench(relay_bin, *MODEL, "--prompt-file", CODE_EDIT)
    assert r.returncode != 0 and "--prompt-file gives decode through the engine" in r.stderr


SPEC_REFUSED = [
    (CPU + ["--model", DEMO_MODEL, "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'],
     "unknown method 'eagle'"),
    (CPU + ["--model", DEMO_MODEL, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 99}'],
     "'num_speculative_tokens' must be between 1 and 16"),
    (CPU + ["--model", DEMO_MODEL, "--speculative-config", "{not json"], "--speculative-config"),
    (CPU + ["--model", DEMO_MODEL, "--spec-forced-acceptance", 0.5], "it needs --speculative-config"),
    (MODEL + ["--speculative-config", MTP], "an MTP head drafts through the engine"),
    (["--mode", "kernels", "--speculative-config", MTP], "--mode kernels has none"),
    (CPU + ["--model", DEMO_MODEL, "--speculative-config", MTP],
     "MTP was requested but the checkpoint"),
    (["--mode", "kernels", "--device", "cpu"], "--device cpu measures decode through the engine"),
    (CPU + ["--model", DEMO_MODEL, "--prefill-lengths", 64], "the engine mode measures decode only"),
    (MODEL + ["--decode-tokens", 8], "--decode-tokens sets the timed tokens"),
    (["--mode", "engine", "--model", DEMO_MODEL, "--prefill-lengths", 64],
     "the engine mode measures decode only"),
    (["--mode", "engine", "--model", DEMO_MODEL, "--threads", 2], "--threads sizes the cpu device"),
    (["--mode", "engine"], "bench --mode engine needs --model DIR"),
    (CPU + ["--model", DEMO_MODEL, "--enforce-eager"], "--enforce-eager turns CUDA graphs off"),
    (MODEL + ["--enforce-eager"], "--enforce-eager turns CUDA graphs off"),
]


@pytest.mark.parametrize("args,needle", SPEC_REFUSED, ids=[n for _, n in SPEC_REFUSED])
def test_bad_speculative_bench_configs_are_refused(relay_bin, args, needle):
    r = bench(relay_bin, *args)
    assert r.returncode != 0 and "relay: error:" in r.stderr and needle in r.stderr, (args, r.stderr)
    assert r.stdout == ""


def test_forced_acceptance_is_the_bench_only(relay_bin):
    r = bench(relay_bin, *CPU, "--model", DEMO_MODEL, "--spec-forced-acceptance", 1.5,
              "--speculative-config", MTP)
    assert r.returncode != 0 and "--spec-forced-acceptance" in r.stderr
    for command in ("generate", "serve"):
        r = subprocess.run([str(relay_bin), command, "--spec-forced-acceptance", "0.8", "--prompt", "x"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "spec-forced-acceptance" in r.stderr, (command, r.stderr)
