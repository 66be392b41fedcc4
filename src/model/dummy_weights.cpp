// See dummy_weights.h.
#include "model/dummy_weights.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "core/dtype.h"
#include "core/error.h"
#include "core/hash.h"
#include "model/make_model.h"

namespace relay {
namespace {

// NOTE: windows start at multiples of 64 elements (128 bytes), so every tensor is as aligned as
// a file's would be for the loaders' vector copies.
constexpr int64_t kWindowAlign = 64;
// Extra pool elements beyond the largest tensor: the room the windows' offsets vary in.
constexpr int64_t kPoolSlack = int64_t{1} << 20;

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

LoadFormat parse_load_format(const std::string& text) {
  if (text == "auto") return LoadFormat::kAuto;
  if (text == "dummy") return LoadFormat::kDummy;
  fail(str("--load-format must be auto or dummy, got '", text, "'"));
}

Checkpoint make_dummy_checkpoint(const ModelConfig& config, const std::filesystem::path& dir,
                                 uint64_t seed) {
  // NOTE: experts per expert even where the release fuses them (Qwen3.5-MoE): the loaders read
  // both, and the pool is as large as the largest tensor, which a fused layer's experts would make
  // 4 x the embedding (Qwen3.5-397B-A17B: 8.6 GB instead of 2 GB).
  const std::vector<TensorSpec> specs =
      checkpoint_tensor_specs(config, DType::BF16, ExpertStorage::kPerExpert);
  int64_t largest = 0, largest_constant = 0;
  for (const TensorSpec& s : specs) {
    if (s.dtype != DType::BF16) continue;
    int64_t& bound =
        weight_init_for(config, s.name) == WeightInit::kNormal ? largest : largest_constant;
    bound = std::max(bound, numel(s.shape));
  }
  // storage[0]: the random pool; [1]: ones; [2]: zeros (bf16); then one buffer per F32 tensor.
  std::vector<std::vector<uint8_t>> storage(3);
  const int64_t pool = largest + kPoolSlack;
  storage[0].resize(static_cast<size_t>(pool) * 2);
  const int threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  fill_random_tensor({"relay.dummy_pool", DType::BF16, {pool}}, WeightInit::kNormal, seed, threads,
                     0, storage[0]);
  storage[1].resize(static_cast<size_t>(largest_constant) * 2);
  storage[2].assign(static_cast<size_t>(largest_constant) * 2, 0);
  const uint16_t one = f32_to_bf16(1.0f);
  for (size_t i = 0; i < storage[1].size(); i += 2) std::memcpy(&storage[1][i], &one, 2);

  std::vector<TensorView> views;
  views.reserve(specs.size());
  for (const TensorSpec& s : specs) {
    TensorView v;
    v.name = s.name;
    v.dtype = s.dtype;
    v.shape = s.shape;
    v.nbytes = tensor_bytes(s);
    v.file = str(dir.string(), " (--load-format dummy)");
    const int64_t n = numel(s.shape);
    const WeightInit init = weight_init_for(config, s.name);
    if (s.dtype != DType::BF16) {
      // The few F32 tensors of a release (A_log, the gated norm: one value per head or head dim)
      // are made whole, as make_model writes them.
      std::vector<uint8_t>& own = storage.emplace_back(v.nbytes);
      fill_random_tensor(s, init, seed, 1, 0, own);
      v.data = own.data();
    } else if (init == WeightInit::kOnes) {
      v.data = storage[1].data();
    } else if (init == WeightInit::kZeros) {
      v.data = storage[2].data();
    } else {
      const int64_t windows = (pool - n) / kWindowAlign + 1;
      const int64_t offset =
          static_cast<int64_t>(fnv1a(s.name) % static_cast<uint64_t>(windows)) * kWindowAlign;
      v.data = storage[0].data() + offset * 2;
    }
    views.push_back(std::move(v));
  }
  return Checkpoint(dir, std::move(views), std::move(storage));
}

Checkpoint open_checkpoint(const std::filesystem::path& dir, LoadFormat format) {
  if (format == LoadFormat::kAuto) return Checkpoint(dir);
  return make_dummy_checkpoint(ModelConfig::load(dir), dir);
}

}  // namespace relay
