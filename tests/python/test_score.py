"""`relay score`: per-position fp32 logits against the transformers fixtures (tests/fixtures/models, made by
tests/fixtures/make_model_fixtures.py), the file format bench/hf_compare.py reads, and clear errors for bad
prompt files.

Tolerance as in tests/unit/engine/test_model_fixtures.cpp: the CPU backend and transformers both compute
in fp32 from the same weights, so |relay - hf| <= 1e-4 + 1e-4 * |hf| (measured errors are ~1e-6)."""
import json
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import DEMO_MODEL, FIXTURES

MODELS = FIXTURES / "models"
# qwen3-yarn's reference starts at position 700; `relay score` numbers positions from 0.
UNSHIFTED = ["qwen3-dense", "qwen3-moe", "qwen3-moe-sparse-step", "qwen3-moe-no-norm-topk",
             "qwen3-attention-bias"]


def score(relay_bin, model, prompts, tmp_path, *args, check=True):
    prompts_path = tmp_path / "prompts.json"
    if isinstance(prompts, str):
        prompts_path.write_text(prompts)
    else:
        prompts_path.write_text(json.dumps(prompts))
    out = tmp_path / "logits.f32"
    r = subprocess.run([str(relay_bin), "score", "--model", str(model), "--prompts", str(prompts_path),
                        "--out", str(out), "--threads", "2", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    if not check:
        return r
    assert r.returncode == 0, r.stderr
    return load_logits(out)


def load_logits(out):
    """The logits file and its sidecar, as bench/hf_compare.py reads them: one [num_tokens, vocab] per prompt."""
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    assert meta["format"] == "relay-score-v1" and meta["dtype"] == "float32" and meta["byte_order"] == "little"
    rows = np.fromfile(out, dtype="<f4")
    assert rows.size == meta["num_rows"] * meta["vocab_size"]
    rows = rows.reshape(meta["num_rows"], meta["vocab_size"])
    return meta, [rows[p["row_offset"]:p["row_offset"] + p["num_tokens"]] for p in meta["prompts"]]


def assert_close(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want)
    bound = 1e-4 + 1e-4 * np.abs(want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{what}: |error| {err[worst]:.3g} at row {worst[0]} col {worst[1]}"


@pytest.mark.parametrize("name", UNSHIFTED)
@pytest.mark.parametrize("chunk", [2048, 4])
def test_logits_match_transformers(relay_bin, tmp_path, name, chunk):
    """Every position of every fixture prompt; chunk 4 prefills through the paged KV cache in pieces."""
    model = MODELS / name
    expected = json.loads((model / "expected.json").read_text())
    assert expected["position_offset"] == 0
    reference = load_file(str(model / "expected.safetensors"))
    meta, logits = score(relay_bin, model, expected["prompts"], tmp_path, "--chunk-tokens", chunk)
    config = json.loads((model / "config.json").read_text())
    assert meta["vocab_size"] == config["vocab_size"] and meta["device"] == "cpu"
    assert [p["num_tokens"] for p in meta["prompts"]] == [len(p) for p in expected["prompts"]]
    assert meta["chunk_tokens"] == min(chunk, max(len(p) for p in expected["prompts"]))
    for i, got in enumerate(logits):
        assert_close(got, reference[f"logits_{i}"], f"{name} prompt {i}")


def test_demo_model_last_position(relay_bin, tmp_path):
    """The embedded demo model (151,936-token vocabulary): the fixture keeps prompt 0's last row."""
    expected_dir = MODELS / "relay-demo-moe-expected"
    expected = json.loads((expected_dir / "expected.json").read_text())
    reference = load_file(str(expected_dir / "expected.safetensors"))["last_logits_0"]
    _, logits = score(relay_bin, DEMO_MODEL, expected["prompts"][:2], tmp_path)
    assert logits[0].shape == (len(expected["prompts"][0]), 151936)
    assert_close(logits[0][-1:], reference, "demo prompt 0, last position")
    # The greedy continuation's first token is the arg-max of the last row.
    assert int(np.argmax(logits[1][-1])) == expected["greedy"][1][0]


def test_bad_prompt_files(relay_bin, tmp_path):
    model = MODELS / "qwen3-moe"  # vocab 512, max_position_embeddings 512

    def error(prompts, *args):
        r = score(relay_bin, model, prompts, tmp_path, *args, check=False)
        assert r.returncode != 0, r.stderr
        assert "relay: error:" in r.stderr, r.stderr
        return r.stderr

    prompts_path = str(tmp_path / "prompts.json")
    assert "not valid JSON" in error("[[1, 2,") and prompts_path in error("[[1, 2,")
    assert "expected a JSON list of prompts" in error('{"prompts": [[1]]}')
    assert "the list of prompts is empty" in error([])
    assert "prompt 1 is not a list of token ids (got a number)" in error([[1, 2], 3])
    assert "prompt 0 is not a list of token ids (got a string)" in error(["hello"])
    assert "prompt 1 is empty" in error([[1], []])
    err = error([[1, 2.5]])
    assert "prompt 0, position 1: 2.5 is not an integer token id" in err and prompts_path in err
    assert "prompt 0, position 2: token id 512 is outside the vocabulary [0, 512)" in error([[0, 511, 512]])
    assert "token id -1 is outside the vocabulary" in error([[-1]])
    assert "token id 18446744073709551615 is outside" in error([[18446744073709551615]])
    err = error([[1] * 8, [1] * 513])
    assert "prompt 1 has 513 tokens, longer than the model's context of 512" in err and "max_position_embeddings" in err
    assert "cannot hold the longest prompt" in error([[1] * 40], "--num-kv-blocks", 2, "--block-size", 16)

    r = subprocess.run([str(relay_bin), "score", "--model", str(model), "--prompts", str(tmp_path / "missing.json"),
                        "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode != 0 and f"--prompts {tmp_path / 'missing.json'}: cannot open the file" in r.stderr
    (tmp_path / "ok.json").write_text("[[1, 2, 3]]")
    r = subprocess.run([str(relay_bin), "score", "--model", str(model), "--prompts", str(tmp_path / "ok.json"),
                        "--out", str(tmp_path / "no-such-dir" / "x")], capture_output=True, text=True)
    assert r.returncode != 0 and "cannot open the file for writing" in r.stderr
    r = subprocess.run([str(relay_bin), "score", "--model", str(tmp_path / "no-model"), "--prompts",
                        str(tmp_path / "ok.json"), "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert r.returncode != 0 and "relay: error:" in r.stderr
    r = subprocess.run([str(relay_bin), "score", "--prompts", str(tmp_path / "ok.json")], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "--out" in r.stderr
    # The cpu device computes in fp32 and says so, as generate does.
    assert "--dtype fp8 is a GPU weight format" in error([[1, 2]], "--dtype", "fp8")
