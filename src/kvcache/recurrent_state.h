// The recurrent-state pool: the per-sequence memory of a model's linear-attention (Gated DeltaNet)
// layers, beside the paged KV pool of its attention layers (kv_cache.h).
//
// A Gated DeltaNet layer keeps no per-token cache: each sequence carries, per such layer, a conv
// state (the last kernel_size - 1 inputs of its short convolution, [conv_dim, conv_width]) and an
// fp32 SSM state ([num_heads, key_dim, value_dim], one key_dim x value_dim matrix per value head:
// transformers' and FLA's K-first layout). Their size is fixed however long the sequence. The pool
// holds `num_slots` equal slots, each one sequence's state for every linear-attention layer:
//   pool[slot][layer][conv state | ssm state]
// so one sequence's whole state is one contiguous byte range (a disaggregated hand-off or a
// prefix-cache snapshot copies it as one piece), and within a layer the conv state of a channel
// slice is one contiguous range too (tensor parallelism slices channels and heads). Which sequence
// owns which slot is decided elsewhere (state_slots.h); the model reads the slot of each sequence
// from its ForwardBatch. RecurrentStateLayout is pure arithmetic over the shape (shared with device
// pools); RecurrentStatePool owns fp32 host storage for the CPU backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace relay {

struct RecurrentStateLayout {
  int num_layers = 0;  // linear-attention layers (their own numbering, in layer order)
  int num_slots = 0;
  int conv_dim = 0;    // channels of the short convolution (q | k | v of every head)
  int conv_width = 0;  // columns kept per channel: kernel_size - 1
  int num_heads = 0;   // value heads
  int key_dim = 0;     // per head
  int value_dim = 0;   // per head
  size_t element_bytes = 4;

  // Sizes and strides in elements.
  int64_t conv_elements() const { return static_cast<int64_t>(conv_dim) * conv_width; }
  int64_t ssm_elements() const { return static_cast<int64_t>(num_heads) * key_dim * value_dim; }
  int64_t layer_stride() const { return conv_elements() + ssm_elements(); }
  int64_t slot_stride() const { return num_layers * layer_stride(); }
  int64_t num_elements() const { return num_slots * slot_stride(); }
  size_t bytes_per_slot() const { return static_cast<size_t>(slot_stride()) * element_bytes; }
  size_t total_bytes() const { return static_cast<size_t>(num_elements()) * element_bytes; }

  // Element offsets from the pool start of (slot, layer)'s conv state and SSM state.
  int64_t conv_offset(int slot, int layer) const {
    return slot * slot_stride() + layer * layer_stride();
  }
  int64_t ssm_offset(int slot, int layer) const {
    return conv_offset(slot, layer) + conv_elements();
  }
};

// fp32 host storage for a layout (the CPU backend's recurrent state), zero-filled.
class RecurrentStatePool {
 public:
  explicit RecurrentStatePool(const RecurrentStateLayout& layout);

  const RecurrentStateLayout& layout() const { return layout_; }
  // Layer `layer`'s conv / SSM state in slot 0; slot i's is slot_stride() elements further on
  // (the kernels' state_stride).
  float* conv(int layer) { return data_.data() + layout_.conv_offset(0, layer); }
  float* ssm(int layer) { return data_.data() + layout_.ssm_offset(0, layer); }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  // Copies slot `src`'s whole state (every layer) over slot `dst`'s: a rollback to a snapshot.
  void copy_slot(int dst, int src);

 private:
  RecurrentStateLayout layout_;
  std::vector<float> data_;
};

}  // namespace relay
