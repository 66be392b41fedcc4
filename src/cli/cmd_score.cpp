// `relay score`: the full-vocabulary logits of every position of a few prompts, for comparing Relay
// with another implementation (bench/hf_compare.py runs it against Hugging Face transformers).
//
// Input: a JSON file holding a list of prompts, each a list of token ids. Output: FILE, raw
// little-endian float32, the prompts' logits one after the other, each [num_tokens, vocab]
// row-major (row t is the distribution of the token after position t, as transformers' `logits`),
// and FILE.json beside it with the shapes and row offsets, so numpy reads it with `np.fromfile`.
//
// It drives the backend directly through `forward_logits(..., kAllTokens)`, the facility the
// backend tests use, rather than the engine: the engine samples and so only ever sees the last row
// of a prompt. A prompt longer than --chunk-tokens is prefilled in chunks through the paged KV
// cache, as the scheduler does, so long prompts need no larger per-step buffers. Every prompt is
// checked (a list of integer ids, inside the vocabulary, inside the model's context) before the
// weights are loaded, and an error names the file, the prompt and the position.
#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "cli/backend_choice.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/json.h"
#include "engine/cpu_backend.h"
#include "model/config.h"
#if RELAY_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif

namespace relay::cli {
namespace {

static_assert(std::endian::native == std::endian::little,
              "relay score writes its host floats as little-endian float32");

struct ScoreOptions {
  std::string model_dir = default_model_dir();
  std::string prompts_path;
  std::string out_path;
  int chunk_tokens = 2048;  // tokens per forward pass
  BackendChoice backend;
};

const char* json_kind(const nlohmann::json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return "a list";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_null()) return "null";
  return "a number";
}

// Reads and checks the prompts file against the model's vocabulary and context.
std::vector<std::vector<int32_t>> read_prompts(const std::string& path, const ModelConfig& config,
                                               const std::string& model_dir) {
  RELAY_CHECK(std::filesystem::exists(path), "--prompts ", path, ": cannot open the file");
  const nlohmann::json j = parse_json_file(path);
  RELAY_CHECK(j.is_array(), path,
              ": expected a JSON list of prompts, each a list of token ids; got ", json_kind(j));
  RELAY_CHECK(!j.empty(), path, ": the list of prompts is empty");
  const int64_t vocab = config.vocab_size;
  const int64_t context = config.max_position_embeddings;
  std::vector<std::vector<int32_t>> prompts;
  for (size_t p = 0; p < j.size(); ++p) {
    const nlohmann::json& ids = j[p];
    RELAY_CHECK(ids.is_array(), path, ": prompt ", p, " is not a list of token ids (got ",
                json_kind(ids), ")");
    RELAY_CHECK(!ids.empty(), path, ": prompt ", p, " is empty");
    RELAY_CHECK(context <= 0 || static_cast<int64_t>(ids.size()) <= context, path, ": prompt ", p,
                " has ", ids.size(), " tokens, longer than the model's context of ", context,
                " (max_position_embeddings in ", model_dir, "/config.json)");
    std::vector<int32_t> tokens;
    tokens.reserve(ids.size());
    for (size_t t = 0; t < ids.size(); ++t) {
      const nlohmann::json& id = ids[t];
      RELAY_CHECK(id.is_number_integer(), path, ": prompt ", p, ", position ", t, ": ", id.dump(),
                  " is not an integer token id");
      const bool in_range = id.is_number_unsigned()
                                ? id.get<uint64_t>() < uint64_t(vocab)
                                : id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab;
      RELAY_CHECK(in_range, path, ": prompt ", p, ", position ", t, ": token id ", id.dump(),
                  " is outside the vocabulary [0, ", vocab, ") of ", model_dir);
      tokens.push_back(static_cast<int32_t>(id.get<int64_t>()));
    }
    prompts.push_back(std::move(tokens));
  }
  return prompts;
}

// Logits of every token of `batch` ([num_tokens, vocab]), from whichever backend was built.
std::vector<float> all_token_logits(Backend& backend, std::span<const StepSequence> batch) {
  if (auto* cpu = dynamic_cast<CpuBackend*>(&backend)) {
    return cpu->forward_logits(batch, CpuBackend::LogitRows::kAllTokens);
  }
#if RELAY_HAVE_CUDA
  if (auto* cuda = dynamic_cast<CudaBackend*>(&backend)) {
    return cuda->forward_logits(batch, CudaBackend::LogitRows::kAllTokens);
  }
#endif
  fail("relay score: this backend cannot return per-position logits");
}

int run_score(ScoreOptions o) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig config = ModelConfig::load(o.model_dir);
  const std::vector<std::vector<int32_t>> prompts =
      read_prompts(o.prompts_path, config, o.model_dir);
  size_t longest = 0, total_rows = 0;
  for (const auto& p : prompts) {
    longest = std::max(longest, p.size());
    total_rows += p.size();
  }
  const int chunk = static_cast<int>(std::min<size_t>(o.chunk_tokens, longest));
  const int bs = o.backend.block_size;
  const int blocks_needed = static_cast<int>((longest + bs - 1) / bs);
  // NOTE: one sequence at a time, so the pool only needs the longest prompt's blocks unless
  // --num-kv-blocks says otherwise (a CUDA pool would otherwise take all the memory left).
  if (o.backend.num_kv_blocks == 0) o.backend.num_kv_blocks = blocks_needed;
  RELAY_CHECK(o.backend.num_kv_blocks >= blocks_needed, "--num-kv-blocks ", o.backend.num_kv_blocks,
              " x --block-size ", bs, " tokens cannot hold the longest ", "prompt of ",
              o.prompts_path, " (", longest, " tokens)");

  // NOTE: max_num_seqs sizes the CUDA backend's logits buffer (forward_logits runs the LM head that
  // many rows at a time) and may not exceed its tokens per step.
  const int max_num_seqs = std::min(chunk, 128);
  // A follower node reads the same prompts, so its pools are node 0's.
  if (is_follower_node(o.backend)) return follow_leader(o.model_dir, o.backend, max_num_seqs);
  const Clock::time_point load_start = Clock::now();
  std::unique_ptr<Backend> backend =
      make_backend(o.model_dir, o.backend, max_num_seqs, /*max_num_batched_tokens=*/chunk);
  const double load_s = std::chrono::duration<double>(Clock::now() - load_start).count();
  const int64_t vocab = backend->config().vocab_size;

  std::ofstream out(o.out_path, std::ios::binary | std::ios::trunc);
  RELAY_CHECK(out.good(), "--out ", o.out_path, ": cannot open the file for writing");
  nlohmann::ordered_json meta_prompts = nlohmann::ordered_json::array();
  std::vector<int32_t> blocks(blocks_needed);
  std::iota(blocks.begin(), blocks.end(), 0);
  size_t row_offset = 0;
  double compute_s = 0.0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<int32_t>& tokens = prompts[p];
    const Clock::time_point start = Clock::now();
    for (size_t begin = 0; begin < tokens.size(); begin += chunk) {
      const size_t n = std::min<size_t>(chunk, tokens.size() - begin);
      StepSequence s;
      s.seq_id = static_cast<int64_t>(p);
      s.tokens = std::span<const int32_t>(tokens).subspan(begin, n);
      s.num_computed = static_cast<int32_t>(begin);
      s.block_table = std::span<const int32_t>(blocks).first((begin + n + bs - 1) / bs);
      const std::vector<StepSequence> batch{s};
      const std::vector<float> logits = all_token_logits(*backend, batch);
      RELAY_CHECK(logits.size() == n * size_t(vocab), "relay score: the backend returned ",
                  logits.size(), " logits for ", n, " tokens of vocabulary ", vocab);
      out.write(reinterpret_cast<const char*>(logits.data()),
                static_cast<std::streamsize>(logits.size() * sizeof(float)));
      RELAY_CHECK(out.good(), "--out ", o.out_path, ": writing failed (disk full?)");
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    compute_s += seconds;
    std::fprintf(stderr, "relay score: prompt %zu: %zu tokens in %.3f s\n", p, tokens.size(),
                 seconds);
    meta_prompts.push_back(
        {{"num_tokens", tokens.size()}, {"row_offset", row_offset}, {"seconds", seconds}});
    row_offset += tokens.size();
  }
  out.close();
  RELAY_CHECK(!out.fail(), "--out ", o.out_path, ": closing failed");

  const nlohmann::ordered_json meta = {
      {"format", "relay-score-v1"},
      {"logits_file", o.out_path},
      {"dtype", "float32"},
      {"byte_order", "little"},
      {"layout", "prompts one after the other, each [num_tokens, vocab_size] row-major"},
      {"vocab_size", vocab},
      {"num_rows", total_rows},
      {"prompts", meta_prompts},
      {"model", o.model_dir},
      {"architecture", backend->config().architecture},
      {"device", o.backend.device},
      {"weights", o.backend.dtype},
      {"chunk_tokens", chunk},
      {"load_seconds", load_s},
      {"compute_seconds", compute_s},
  };
  const std::string meta_path = o.out_path + ".json";
  std::ofstream meta_out(meta_path, std::ios::trunc);
  meta_out << meta.dump(1) << "\n";
  meta_out.close();
  RELAY_CHECK(!meta_out.fail(), "--out ", o.out_path, ": cannot write the sidecar ", meta_path);
  std::fprintf(
      stderr, "relay score: %zu prompts, %zu rows x %lld logits -> %s (+ .json); load %.2f s\n",
      prompts.size(), total_rows, static_cast<long long>(vocab), o.out_path.c_str(), load_s);
  return 0;
}

CommandRegistrar score_command({
    "score",
    [](CLI::App& sub) -> std::function<int()> {
      auto o = std::make_shared<ScoreOptions>();
      sub.add_option("--model", o->model_dir,
                     "checkpoint directory (default: the embedded demo model)");
      sub.add_option("--prompts", o->prompts_path,
                     "JSON file: a list of prompts, each a list of token ids")
          ->required();
      sub.add_option("--out", o->out_path,
                     "logits file: raw little-endian float32, every prompt's [num_tokens, vocab] "
                     "one after the other; shapes go to FILE.json")
          ->required();
      sub.add_option("--chunk-tokens", o->chunk_tokens,
                     "tokens per forward pass; longer prompts are prefilled in chunks through the "
                     "KV cache (default 2048)")
          ->check(CLI::PositiveNumber);
      add_backend_options(sub, o->backend);
      return [o] { return run_score(*o); };
    },
    "write the fp32 logits of every position of token-id prompts (a JSON file) for comparisons",
});

}  // namespace
}  // namespace relay::cli
