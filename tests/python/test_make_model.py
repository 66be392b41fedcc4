"""`relay make-model` end to end: the checkpoints it writes must read back with the reference
`safetensors` library and match the Hugging Face layout (config, generation config, tokenizer,
shards and index). transformers itself was checked once by hand (no torch in CI):
  /opt/oracle/bin/python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained(DIR)"
loads both tiny presets with no missing or unexpected keys."""
import json
import struct
import subprocess

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import DEMO_MODEL


def make_model(relay_bin, out, *args):
    result = subprocess.run([str(relay_bin), "make-model", "--out", str(out), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def raw_tensors(path):
    """Parses a safetensors file by hand: {name: (dtype, shape, bytes)} plus the header length."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
            for k, v in header.items()}, n


def bf16_to_f32(raw):
    return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x):
    """Round to nearest even, as torch and Relay do (no NaNs in random weights)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_tiny_moe_matches_hf_layout(relay_bin, tmp_path):
    out = tmp_path / "tiny-moe"
    make_model(relay_bin, out, "--preset", "tiny-moe", "--seed", "3")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["model_type"] == "qwen3_moe"
    assert config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == 2 and config["num_experts"] == 8
    assert config["tie_word_embeddings"] is False
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (DEMO_MODEL / name).read_bytes()
    assert not (out / "model.safetensors.index.json").exists()

    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    experts, moe_width, vocab = 8, 32, 151936
    expected = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
                "model.norm.weight": [hidden]}
    for layer in range(2):
        p = f"model.layers.{layer}."
        expected.update({
            p + "input_layernorm.weight": [hidden],
            p + "post_attention_layernorm.weight": [hidden],
            p + "self_attn.q_proj.weight": [heads * head_dim, hidden],
            p + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
            p + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
            p + "self_attn.o_proj.weight": [hidden, heads * head_dim],
            p + "self_attn.q_norm.weight": [head_dim],
            p + "self_attn.k_norm.weight": [head_dim],
            p + "mlp.gate.weight": [experts, hidden],
        })
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            expected.update({q + "gate_proj.weight": [moe_width, hidden],
                             q + "up_proj.weight": [moe_width, hidden],
                             q + "down_proj.weight": [hidden, moe_width]})

    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected)
        for name, shape in expected.items():
            sl = f.get_slice(name)
            assert sl.get_shape() == shape, name
            assert sl.get_dtype() == "BF16", name

    tensors, header_len = raw_tensors(out / "model.safetensors")
    assert header_len % 8 == 0  # padded like the Python library pads
    for name in expected:
        values = bf16_to_f32(tensors[name][2])
        if name.endswith("norm.weight"):
            assert np.all(values == 1.0), name
    embed = bf16_to_f32(tensors["model.embed_tokens.weight"][2]).astype(np.float64)
    assert abs(embed.mean()) < 1e-4
    assert abs(embed.std() - 0.02) < 2e-4

    # The same seed in f32 gives the unrounded values; the reference library loads them directly.
    out32 = tmp_path / "tiny-moe-f32"
    make_model(relay_bin, out32, "--preset", "tiny-moe", "--seed", "3", "--dtype", "f32")
    assert json.loads((out32 / "config.json").read_text())["torch_dtype"] == "float32"
    weights = load_file(str(out32 / "model.safetensors"))
    assert set(weights) == set(expected)
    for name, array in weights.items():
        assert array.dtype == np.float32 and list(array.shape) == expected[name]
        bits = np.frombuffer(tensors[name][2], dtype=np.uint16)
        assert np.array_equal(bits, f32_to_bf16_bits(array.reshape(-1))), name


def test_sharded_checkpoint_has_a_complete_index(relay_bin, tmp_path):
    out = tmp_path / "tiny-dense"
    result = make_model(relay_bin, out, "--preset", "tiny-dense", "--shard-size", "5", "--layers", "3")
    assert "wrote" in result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    total = 0
    seen = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="numpy") as f:
            for name in f.keys():
                seen[name] = shard
                total += int(np.prod(f.get_slice(name).get_shape())) * 2
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    assert "lm_head.weight" not in seen  # tied
    assert "model.layers.2.mlp.down_proj.weight" in seen
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3


def test_errors_are_reported(relay_bin, tmp_path):
    bad = subprocess.run([str(relay_bin), "make-model", "--preset", "tiny-llama", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "tiny-llama" in bad.stderr and "tiny-moe" in bad.stderr
    bad = subprocess.run([str(relay_bin), "make-model", "--preset", "tiny-moe", "--out", str(tmp_path / "y"),
                          "--dtype", "f16"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0


def test_config_only_directory_runs_with_dummy_weights(relay_bin, tmp_path):
    """make-model --config-only writes a model directory without weights; `--load-format dummy`
    makes random ones at load (vLLM's flag), the same on every run, through generate and serve."""
    out = tmp_path / "config-only"
    # The tiny preset with the tokenizer's vocabulary, so a real prompt's ids fit.
    make_model(relay_bin, out, "--preset", "tiny-moe", "--config-only", "--config-patch", '{"vocab_size": 151936}')
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    cmd = [str(relay_bin), "generate", "--model", str(out), "--prompt", "def f(x):", "--max-tokens", "8",
           "--ignore-eos", "--threads", "2"]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "relay: error:" in missing.stderr
    runs = [subprocess.run(cmd + ["--load-format", "dummy", *layout], capture_output=True, text=True, timeout=120)
            for layout in ([], [], ["--tp", "2"])]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout == runs[1].stdout
    bad = subprocess.run(cmd + ["--load-format", "pt"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--load-format" in bad.stderr


def generate(relay_bin, model, *args):
    return subprocess.run([str(relay_bin), "generate", "--model", str(model), "--prompt", "def f(x):",
                           "--ignore-eos", "--threads", "2", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_tiny_hybrid_checkpoints_load_and_generate(relay_bin, tmp_path):
    """The hybrid layouts as make-model writes them (Qwen3.5: model.language_model.*, split Gated DeltaNet
    projections, fused experts, F32 A_log, an MTP head; Qwen3-Next: fused interleaved in_proj_qkvz / ba)
    load through relay generate and run; Qwen3.5's own MTP head drafts, losslessly."""
    for preset in ("tiny-qwen3.5-moe", "tiny-qwen3-next"):
        out = tmp_path / preset
        make_model(relay_bin, out, "--preset", preset, "--layers", "8")
        config = json.loads((out / "config.json").read_text())
        text = config.get("text_config", config)
        assert text["num_hidden_layers"] == 8
        plain = generate(relay_bin, out, "--max-tokens", 12)
        assert plain.returncode == 0, plain.stderr
        assert "decode 11 tokens" in plain.stderr
        if preset == "tiny-qwen3.5-moe":
            assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
            assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + \
                ["linear_attention"] * 3 + ["full_attention"]
            with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
                names = set(f.keys())
                assert f.get_slice("model.language_model.layers.0.linear_attn.A_log").get_dtype() == "F32"
            assert "model.language_model.layers.7.mlp.experts.gate_up_proj" in names
            assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in names
            spec = generate(relay_bin, out, "--max-tokens", 12,
                            "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
            assert spec.returncode == 0, spec.stderr
            assert spec.stdout == plain.stdout
            assert "speculative decoding (mtp k=2)" in spec.stderr
        else:
            assert config["architectures"] == ["Qwen3NextForCausalLM"]
            assert "layer_types" not in config and config["full_attention_interval"] == 4


def test_hybrid_presets_keep_their_layer_pattern(relay_bin, tmp_path):
    bad = subprocess.run([str(relay_bin), "make-model", "--preset", "qwen3.5-397b-a17b", "--layers", "6",
                          "--config-only", "--out", str(tmp_path / "x")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0
    assert "--layers 6" in bad.stderr and "give a multiple of 4" in bad.stderr
    make_model(relay_bin, tmp_path / "y", "--preset", "qwen3.5-397b-a17b", "--layers", "8", "--config-only")
    config = json.loads((tmp_path / "y" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert set(config) >= {"text_config", "vision_config"}
    text = config["text_config"]
    assert text["num_hidden_layers"] == 8 and len(text["layer_types"]) == 8
    assert [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"] == [3, 7]
    assert (text["hidden_size"], text["num_experts"], text["num_experts_per_tok"]) == (4096, 512, 10)


def test_config_only_hybrid_preset_runs_with_dummy_weights(relay_bin, tmp_path):
    """Qwen3-Next-80B-A3B's shapes at 4 layers from config.json alone (the expert count cut to 16 so
    the CPU backend's fp32 copy fits CI: the layout and every width stay the release's)."""
    out = tmp_path / "next"
    make_model(relay_bin, out, "--preset", "qwen3-next-80b-a3b", "--layers", "4", "--config-only",
               "--config-patch", '{"num_experts": 16}')
    assert not list(out.glob("*.safetensors"))
    r = generate(relay_bin, out, "--max-tokens", 3, "--load-format", "dummy")
    assert r.returncode == 0, r.stderr
    assert "decode 2 tokens" in r.stderr
