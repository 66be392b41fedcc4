// `relay quantize` (quantize_checkpoint) on a random tiny-moe checkpoint from make_model: the
// output keeps the shards and the HF names, every linear weight becomes F8_E4M3 with scales of the
// right dtype and shape, kept tensors are bf16 with their values, config.json's quantization_config
// parses back and lists the kept modules, and the stored weights dequantise to the recipe's values
// within the e4m3 bound of the originals.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/make_model.h"
#include "model/safetensors.h"
#include "convert/quantize_checkpoint.h"
#include "kernels/fp8_ops.h"
#include "quant/weight_quant.h"

namespace relay::quant {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("relay_quant_" + name);
  fs::remove_all(dir);
  return dir;
}

// A tiny-moe checkpoint split into several shards (embed and lm_head are ~19 MB each in bf16).
fs::path make_tiny_moe(const std::string& name, DType dtype) {
  MakeModelOptions o;
  o.preset = "tiny-moe";
  o.out_dir = temp_dir(name);
  o.tokenizer_dir = fs::path(RELAY_SOURCE_DIR) / "models" / "relay-demo-moe";
  o.dtype = dtype;
  o.shard_size_mb = 8;
  o.num_threads = 2;
  make_model(o);
  return o.out_dir;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

StoredTensor stored(const TensorView& t) { return {t.name, t.file, t.dtype, t.shape, t.data}; }

void check_converted(const fs::path& in_dir, const fs::path& out_dir, QuantMethod method) {
  const Checkpoint in(in_dir), out(out_dir);
  const QuantConfig config = QuantConfig::load(out_dir);
  ASSERT_EQ(config.method, method);

  // Same shard files, each tensor in the shard its source was in.
  const nlohmann::json in_index = read_json(in_dir / "model.safetensors.index.json");
  const nlohmann::json out_index = read_json(out_dir / "model.safetensors.index.json");
  ASSERT_GT(in_index["weight_map"].size(), 0u);

  int quantized = 0, kept = 0;
  for (const std::string& name : in.names()) {
    const TensorView& src = in.get(name);
    const TensorView& dst = out.get(name);
    EXPECT_EQ(dst.shape, src.shape) << name;
    EXPECT_EQ(out_index["weight_map"][name], in_index["weight_map"][name]) << name;
    const std::vector<float> original = tensor_to_f32(src);
    if (!is_quantizable_weight(name, src.shape.size())) {
      ++kept;
      EXPECT_EQ(dst.dtype, DType::BF16) << name;
      const std::vector<float> values = tensor_to_f32(dst);
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(values[i], bf16_to_f32(f32_to_bf16(original[i]))) << name << "[" << i << "]";
      }
      continue;
    }
    ++quantized;
    ASSERT_EQ(dst.dtype, DType::F8_E4M3) << name;
    const std::string scale_name = scale_tensor_name(config, name);
    EXPECT_EQ(out_index["weight_map"][scale_name], in_index["weight_map"][name]) << scale_name;
    const TensorView& scale = out.get(scale_name);
    const int64_t rows = src.shape[0], cols = src.shape[1];
    std::vector<float> deq(rows * cols), expected(rows * cols);
    dequantize_stored_weight(config, stored(dst), stored(scale), deq.data());
    std::vector<uint8_t> q(rows * cols);
    if (method == QuantMethod::Fp8Block) {
      EXPECT_EQ(scale.dtype, DType::F32);
      EXPECT_EQ(scale.shape, (std::vector<int64_t>{kernels::ceil_div(rows, 128), kernels::ceil_div(cols, 128)}));
      std::vector<float> s(kernels::ceil_div(rows, 128) * kernels::ceil_div(cols, 128));
      kernels::quantize_weight_fp8_block(original.data(), rows, cols, 128, 128, q.data(), s.data());
      kernels::dequantize_weight_fp8_block(q.data(), s.data(), rows, cols, 128, 128, expected.data());
    } else {
      EXPECT_EQ(scale.dtype, DType::F8_E8M0);
      EXPECT_EQ(scale.shape, (std::vector<int64_t>{rows, kernels::ceil_div(cols, 32)}));
      std::vector<uint8_t> s(rows * kernels::ceil_div(cols, 32));
      kernels::quantize_weight_mxfp8(original.data(), rows, cols, q.data(), s.data());
      kernels::dequantize_weight_mxfp8(q.data(), s.data(), rows, cols, expected.data());
    }
    EXPECT_EQ(std::vector<uint8_t>(dst.data, dst.data + dst.nbytes), q) << name;
    EXPECT_EQ(deq, expected) << name;
    float amax = 0;
    for (float v : original) amax = std::max(amax, std::fabs(v));
    for (size_t i = 0; i < deq.size(); ++i) {
      // 2^-4 relative (3 mantissa bits); subnormal steps of 2^-9 of a scale no larger than
      // amax/224.
      ASSERT_LE(std::fabs(deq[i] - original[i]),
                std::max(std::fabs(original[i]) * 0x1p-4f, amax * 0x1p-16f))
          << name << "[" << i << "]";
    }
  }
  // tiny-moe: 2 layers x (q, k, v, o + 8 experts x 3) linear weights.
  EXPECT_EQ(quantized, 2 * (4 + 8 * 3));
  EXPECT_GT(kept, 0);
  EXPECT_EQ(out.names().size(), in.names().size() + quantized);

  for (const char* module :
       {"lm_head", "model.embed_tokens", "model.norm", "model.layers.0.mlp.gate",
        "model.layers.1.input_layernorm", "model.layers.0.self_attn.q_norm"}) {
    EXPECT_TRUE(config.keeps_unquantized(module)) << module;
  }
  for (const char* module :
       {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.experts.7.down_proj"}) {
    EXPECT_FALSE(config.keeps_unquantized(module)) << module;
  }
  for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    EXPECT_TRUE(fs::exists(out_dir / file)) << file;
  }
  // The rest of config.json is unchanged.
  nlohmann::json in_config = read_json(in_dir / "config.json"),
                 out_config = read_json(out_dir / "config.json");
  out_config.erase("quantization_config");
  EXPECT_EQ(out_config, in_config);
}

TEST(QuantizeCheckpoint, Fp8Block128FromBf16) {
  const fs::path in = make_tiny_moe("in_bf16", DType::BF16), out = temp_dir("out_fp8");
  const QuantizeResult r = quantize_checkpoint({in, out, QuantMethod::Fp8Block, {}});
  EXPECT_GT(r.num_shards, 1);
  EXPECT_EQ(r.num_quantized, 56);
  EXPECT_LT(r.bytes_out, r.bytes_in);
  check_converted(in, out, QuantMethod::Fp8Block);
  const nlohmann::json qc = read_json(out / "config.json")["quantization_config"];
  EXPECT_EQ(qc["quant_method"], "fp8");
  EXPECT_EQ(qc["fmt"], "e4m3");
  EXPECT_EQ(qc["activation_scheme"], "dynamic");
  EXPECT_EQ(qc["weight_block_size"], nlohmann::json::parse("[128, 128]"));

  // An FP8 checkpoint is not an input.
  const std::string again = [&] {
    try {
      quantize_checkpoint({out, temp_dir("again"), QuantMethod::Fp8Block, {}});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  }();
  EXPECT_NE(again.find("already has a quantization_config"), std::string::npos) << again;
  EXPECT_THROW(quantize_checkpoint({in, in, QuantMethod::Fp8Block, {}}), Error);
  EXPECT_THROW(parse_quant_format("fp8-block64"), Error);
}

TEST(QuantizeCheckpoint, MxFp8FromF32) {
  const fs::path in = make_tiny_moe("in_f32", DType::F32), out = temp_dir("out_mx");
  quantize_checkpoint({in, out, parse_quant_format("mxfp8"), {}});
  check_converted(in, out, QuantMethod::Mxfp8);
  EXPECT_EQ(read_json(out / "config.json")["quantization_config"]["quant_method"], "mxfp8");
}

// Tensors larger than one write chunk (kWriteChunkBytes = 64 MiB): the converter is asked for each
// tensor's bytes in several pieces, and every piece must land at its offset — codes of a bf16
// weight with 67.2M elements, and a kept f32 tensor converted to bf16 (67.2 MB out).
TEST(QuantizeCheckpoint, StreamsTensorsLargerThanOneWriteChunk) {
  const fs::path in = temp_dir("large_in"), out = temp_dir("large_out");
  fs::create_directories(in);
  std::ofstream(in / "config.json") << R"({"architectures": ["Qwen3MoeForCausalLM"]})";
  const int64_t rows = 8200, cols = 8192, kept_rows = 16400, kept_cols = 2048;
  ASSERT_GT(rows * cols, static_cast<int64_t>(kWriteChunkBytes));
  ASSERT_GT(kept_rows * kept_cols * 2, static_cast<int64_t>(kWriteChunkBytes));
  const auto value = [](int64_t i) {
    return static_cast<float>((i * 2654435761ll) % 2001 - 1000) * 1e-5f;
  };
  {
    std::vector<TensorToWrite> tensors(2);
    tensors[0] = {"model.layers.0.mlp.down_proj.weight", DType::BF16, {rows, cols}, {}};
    tensors[0].bytes.resize(rows * cols * 2);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const uint16_t v = f32_to_bf16(value(i));
      std::memcpy(tensors[0].bytes.data() + 2 * i, &v, 2);
    }
    tensors[1] = {"model.embed_tokens.weight", DType::F32, {kept_rows, kept_cols}, {}};
    tensors[1].bytes.resize(kept_rows * kept_cols * 4);
    for (int64_t i = 0; i < kept_rows * kept_cols; ++i) {
      const float v = value(i + 7);
      std::memcpy(tensors[1].bytes.data() + 4 * i, &v, 4);
    }
    write_safetensors(in / "model.safetensors", tensors);
  }
  quantize_checkpoint({in, out, QuantMethod::Fp8Block, {}});

  const SafetensorsFile result(out / "model.safetensors");
  const TensorView& codes = result.tensors().at("model.layers.0.mlp.down_proj.weight");
  const TensorView& scales = result.tensors().at("model.layers.0.mlp.down_proj.weight_scale_inv");
  ASSERT_EQ(codes.nbytes, static_cast<size_t>(rows * cols));
  // Stripe by stripe, the expected codes and scales from the same recipe on the bf16 values.
  std::vector<float> stripe(128 * cols), stripe_scales(kernels::ceil_div(cols, 128));
  std::vector<uint8_t> stripe_codes(128 * cols);
  for (int64_t r0 = 0; r0 < rows; r0 += 128) {
    const int64_t n = std::min<int64_t>(128, rows - r0);
    for (int64_t i = 0; i < n * cols; ++i)
      stripe[i] = bf16_to_f32(f32_to_bf16(value(r0 * cols + i)));
    kernels::quantize_weight_fp8_block(stripe.data(), n, cols, 128, 128, stripe_codes.data(),
                              stripe_scales.data());
    ASSERT_EQ(std::memcmp(codes.data + r0 * cols, stripe_codes.data(), n * cols), 0)
        << "rows from " << r0;
    ASSERT_EQ(std::memcmp(scales.data + (r0 / 128) * stripe_scales.size() * 4, stripe_scales.data(),
                          stripe_scales.size() * 4),
              0)
        << "scales of rows from " << r0;
  }
  const TensorView& kept = result.tensors().at("model.embed_tokens.weight");
  ASSERT_EQ(kept.dtype, DType::BF16);
  for (int64_t i = 0; i < kept_rows * kept_cols; ++i) {
    uint16_t v;
    std::memcpy(&v, kept.data + 2 * i, 2);
    ASSERT_EQ(v, f32_to_bf16(value(i + 7))) << "element " << i;
  }
  fs::remove_all(in);
  fs::remove_all(out);
}

}  // namespace
}  // namespace relay::quant
