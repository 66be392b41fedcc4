"""`relay quantize` end to end on a tiny-moe checkpoint from `relay make-model`: the output must read
back with the reference `safetensors` library with the Hugging Face names, dtypes and shapes of the
Qwen3-*-FP8 layout (or Relay's MXFP8 layout, docs/fp8.md), and its codes and scales must equal an
independent numpy implementation of the documented recipe, byte for byte.

transformers was checked once by hand with the oracle venv (no torch in CI; see docs/fp8.md):
torch's dequantisation of a `relay quantize` output equals Relay's bit for bit."""
import json
import struct
import subprocess

import numpy as np
import pytest
from safetensors import safe_open

from conftest import DEMO_MODEL


FP8_MAX = np.float32(448.0)


def run(relay_bin, *args, check=True):
    result = subprocess.run([str(relay_bin), *args], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def raw_tensors(path):
    """{name: (dtype, shape, bytes)} parsed by hand from a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items()}


def all_tensors(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update({k: (shard, *v) for k, v in raw_tensors(ckpt / shard).items()})
    return index, out


def to_f32(dtype, raw):
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert dtype == "F32", dtype
    return np.frombuffer(raw, dtype=np.float32)


def e4m3_table():
    """fp32 value of every E4M3 code (NaN for 0x7F/0xFF), from the format's definition."""
    values = np.empty(256, dtype=np.float32)
    for code in range(256):
        e, m = (code >> 3) & 15, code & 7
        v = np.nan if (e == 15 and m == 7) else (m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        values[code] = -v if code & 0x80 else v
    return values


E4M3 = e4m3_table()
POSITIVE = E4M3[:127].astype(np.float64)  # codes 0..126, increasing


def e4m3_encode(x):
    """Round to the nearest E4M3 value, ties to the even code (x already within +-448)."""
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(POSITIVE, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - POSITIVE[lo], POSITIVE[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == 0, 0, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def fp8_block_recipe(w):
    rows, cols = w.shape
    q = np.zeros((rows, cols), dtype=np.uint8)
    scale = np.zeros((-(-rows // 128), -(-cols // 128)), dtype=np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = np.abs(blk).max()
            s = np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = e4m3_encode(np.clip(blk / s, -FP8_MAX, FP8_MAX))
    return q, scale


def mx_recipe(w):
    rows, cols = w.shape
    groups = -(-cols // 32)
    q = np.zeros((rows, cols), dtype=np.uint8)
    codes = np.zeros((rows, groups), dtype=np.uint8)
    for g in range(groups):
        blk = w[:, g * 32:(g + 1) * 32]
        amax = np.abs(blk).max(axis=1).astype(np.float64)
        # smallest e with amax <= 448 * 2^(e - 127)
        e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-300) / 448.0)) + 127, 0)
        e = np.where((amax > 0) & (amax > 448.0 * 2.0 ** (e - 127)), e + 1, e)
        e = np.where((amax > 0) & (amax <= 448.0 * 2.0 ** (e - 128)), e - 1, e).clip(0, 254)
        codes[:, g] = e
        q[:, g * 32:(g + 1) * 32] = e4m3_encode(blk / (2.0 ** (e[:, None] - 127)))
    return q, codes


def quantizable(name, shape):
    return (len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))


@pytest.fixture(scope="module")
def tiny_moe(relay_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "tiny-moe"
    run(relay_bin, "make-model", "--preset", "tiny-moe", "--out", str(out), "--seed", "5", "--shard-size", "8")
    return out


@pytest.mark.parametrize("fmt", ["fp8-block128", "mxfp8"])
def test_quantize_tiny_moe(relay_bin, tiny_moe, tmp_path, fmt):
    out = tmp_path / fmt
    result = run(relay_bin, "quantize", "--in", str(tiny_moe), "--out", str(out), "--format", fmt)
    assert "quantized 56 weights" in result.stderr

    config = json.loads((out / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == json.loads((tiny_moe / "config.json").read_text())
    assert qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
    if fmt == "fp8-block128":
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    else:
        assert qc["quant_method"] == "mxfp8" and qc["group_size"] == 32
    for module in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate",
                   "model.layers.1.post_attention_layernorm"):
        assert module in qc["modules_to_not_convert"]
    assert not any("proj" in m for m in qc["modules_to_not_convert"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tiny_moe / name).read_bytes()

    in_index, inputs = all_tensors(tiny_moe)
    out_index, outputs = all_tensors(out)
    assert len(set(out_index["weight_map"].values())) > 1
    assert out_index["metadata"]["total_size"] == sum(len(v[3]) for v in outputs.values())
    scale_suffix = "_scale_inv" if fmt == "fp8-block128" else "_scale"
    expected_names = set(inputs) | {n + scale_suffix for n, v in inputs.items() if quantizable(n, v[2])}
    assert set(outputs) == expected_names == set(out_index["weight_map"])

    # The reference library reads every tensor's dtype and shape.
    seen = {}
    for shard in sorted(set(out_index["weight_map"].values())):
        with safe_open(out / shard, framework="numpy") as f:
            for name in f.keys():
                s = f.get_slice(name)
                seen[name] = (s.get_dtype(), s.get_shape())
    assert set(seen) == expected_names

    for name, (shard, dtype, shape, raw) in inputs.items():
        w = to_f32(dtype, raw).reshape(shape)
        out_shard, out_dtype, out_shape, out_raw = outputs[name]
        assert out_shard == shard and out_shape == shape, name
        if not quantizable(name, shape):
            assert seen[name] == ("BF16", shape), name
            assert out_raw == raw, name
            continue
        assert seen[name] == ("F8_E4M3", shape), name
        scale_shard, scale_dtype, scale_shape, scale_raw = outputs[name + scale_suffix]
        assert scale_shard == shard, name
        codes = np.frombuffer(out_raw, dtype=np.uint8).reshape(shape)
        if fmt == "fp8-block128":
            q, scale = fp8_block_recipe(w)
            assert seen[name + scale_suffix] == ("F32", [-(-shape[0] // 128), -(-shape[1] // 128)])
            np.testing.assert_array_equal(np.frombuffer(scale_raw, dtype=np.float32).reshape(scale.shape), scale)
            deq = E4M3[codes] * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:shape[0], :shape[1]]
        else:
            q, scale = mx_recipe(w)
            assert seen[name + scale_suffix] == ("F8_E8M0", [shape[0], -(-shape[1] // 32)])
            np.testing.assert_array_equal(np.frombuffer(scale_raw, dtype=np.uint8).reshape(scale.shape), scale)
            deq = E4M3[codes] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, 1)[:, :shape[1]]
        np.testing.assert_array_equal(codes, q, err_msg=name)
        assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) / 16, np.abs(w).max() * 2.0 ** -16)), name


def test_quantize_rejects_bad_input(relay_bin, tiny_moe, tmp_path):
    bad = run(relay_bin, "quantize", "--in", str(tiny_moe), "--out", str(tmp_path / "x"), "--format", "int4",
              check=False)
    assert bad.returncode != 0 and "int4" in bad.stderr
    first = tmp_path / "fp8"
    run(relay_bin, "quantize", "--in", str(tiny_moe), "--out", str(first), "--format", "fp8-block128")
    again = run(relay_bin, "quantize", "--in", str(first), "--out", str(tmp_path / "y"), "--format", "mxfp8",
                check=False)
    assert again.returncode != 0 and "already has a quantization_config" in again.stderr
    missing = run(relay_bin, "quantize", "--in", str(tmp_path / "nope"), "--out", str(tmp_path / "z"),
                  "--format", "mxfp8", check=False)
    assert missing.returncode != 0 and "is not a directory" in missing.stderr


@pytest.mark.parametrize("fmt", ["fp8-block128", "mxfp8"])
def test_generate_with_quantized_demo_model(relay_bin, tmp_path, fmt):
    """The CPU backend serves the converted demo model (weights dequantised at load); greedy text
    starts like the bf16 model's (top-1 agreement is ~97%, docs/fp8.md)."""
    out = tmp_path / fmt
    run(relay_bin, "quantize", "--in", str(DEMO_MODEL), "--out", str(out), "--format", fmt)
    args = ["generate", "--prompt", "Once upon a time, there was a little girl who", "--max-tokens", "16",
            "--threads", "2"]
    reference = run(relay_bin, *args, "--model", str(DEMO_MODEL)).stdout
    quantized = run(relay_bin, *args, "--model", str(out)).stdout
    assert quantized.strip()
    assert quantized.strip().splitlines()[0] == reference.strip().splitlines()[0]
