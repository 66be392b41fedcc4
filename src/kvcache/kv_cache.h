// The paged KV pool's storage and layout (the block manager that hands out block ids lives
// elsewhere).
//
// One allocation holds every layer's K and V pages:
//   pool[layer][kv][block][kv_head][token_in_block][head_dim]      (kv = 0 for K, 1 for V)
// so for one layer, K and V are each [num_blocks, num_kv_heads, block_size, head_dim] — the HND
// layout the kernels take (kernels/ops.h). A head slice of a block, heads [h0, h1), is one
// contiguous range of (h1 - h0) * block_size * head_dim elements: the transfer engine moves exactly
// such ranges between ranks that shard heads differently. A block id names the same page index in
// every layer. KvCacheLayout is pure arithmetic over the shape (shared by the CPU pool here and
// device pools); KvPool owns fp32 host storage for the CPU backend.
//
// `layer` counts the model's attention layers only: a hybrid model (Qwen3.5, Qwen3-Next) keeps
// per-sequence recurrent state for its linear-attention layers instead (recurrent_state.h), so its
// pool holds pages for its attention layers alone, numbered in layer order
// (ModelConfig::kv_cache_layer). For an attention-only model that is every layer, as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace relay {

struct KvByteRange {
  size_t offset = 0;  // bytes from the start of the pool
  size_t bytes = 0;
};

struct KvCacheLayout {
  int num_layers = 0;  // attention layers (every layer of an attention-only model)
  int num_blocks = 0;
  int num_kv_heads = 0;
  int block_size = 0;  // tokens per block
  int head_dim = 0;
  size_t element_bytes = 4;

  // Strides in elements.
  int64_t head_stride() const { return static_cast<int64_t>(block_size) * head_dim; }
  int64_t block_stride() const { return num_kv_heads * head_stride(); }
  int64_t kv_stride() const { return num_blocks * block_stride(); }  // K of a layer -> V of that layer
  int64_t layer_stride() const { return 2 * kv_stride(); }
  int64_t num_elements() const { return num_layers * layer_stride(); }
  size_t total_bytes() const { return static_cast<size_t>(num_elements()) * element_bytes; }
  // Bytes one block id costs across all layers, K and V.
  size_t bytes_per_block() const {
    return static_cast<size_t>(num_layers) * 2 * block_stride() * element_bytes;
  }

  // Element offset of (layer, kv, block, head, token 0) from the pool start; kv 0 = K, 1 = V.
  int64_t element_offset(int layer, int kv, int block, int head) const {
    return layer * layer_stride() + kv * kv_stride() + block * block_stride() + head * head_stride();
  }
  // The contiguous bytes of heads [head_begin, head_end) of one block's K (or V) in one layer.
  KvByteRange k_range(int layer, int block, int head_begin, int head_end) const;
  KvByteRange v_range(int layer, int block, int head_begin, int head_end) const;

  // A layout with as many blocks as fit in `budget_bytes` (at least one, else an error).
  static KvCacheLayout from_budget(int num_layers, int num_kv_heads, int head_dim, int block_size,
                                   size_t element_bytes, size_t budget_bytes);
};

// fp32 host storage for a layout (the CPU backend's KV cache).
class KvPool {
 public:
  explicit KvPool(const KvCacheLayout& layout);

  const KvCacheLayout& layout() const { return layout_; }
  float* k(int layer) { return data_.data() + layout_.element_offset(layer, 0, 0, 0); }
  float* v(int layer) { return data_.data() + layout_.element_offset(layer, 1, 0, 0); }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }

 private:
  KvCacheLayout layout_;
  std::vector<float> data_;
};

}  // namespace relay
