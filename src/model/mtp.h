// The MTP (multi-token prediction) draft head of Qwen3.5 / Qwen3-Next checkpoints (their mtp.*
// tensors), or an in-house head trained for a Qwen3 / Qwen3-MoE target and shipped in a directory
// of its own with the same tensor names. Model::forward_mtp runs it (model.h); this file holds its
// weights and loads them.
//
// The forward, with vLLM's semantics (hybrid-and-mtp.md section 3.6), for the row at position p:
//   e = pre_fc_norm_embedding(embed_tokens(t[p + 1]))  the target's embedding
//   h = pre_fc_norm_hidden(hidden[p])                   the target's output after its final norm
//   x = fc(cat([e, h]))                                 [hidden, 2 hidden], no bias, e first
//   x = layer(x) at RoPE position p                     one full-attention decoder layer
//   y = norm(x)                                         the next chained step's hidden input
//   logits = lm_head(y)                                 the target's LM head
// The decoder layer is built from the target's own blocks, so it is "a layer of the target's
// kind": Qwen3 attention (or the hybrids' gated attention, partial rotary, zero-centred q/k norms),
// and the feed-forward config.layer_is_moe(i) picks for MTP layer i (vLLM numbers the MTP layers
// from 0 the same way): the MoE block (with the hybrids' shared expert) or a dense SwiGLU MLP of
// intermediate_size. Experts may be stored per expert or fused (SparseMoe reads both). Norms follow
// the target's convention (zero_centered_norms). The layer caches its K/V in the KV pool's layer
// config.num_kv_cache_layers() + i, after the target's attention layers, with the same block
// tables as the target. Sharded, the layer follows the ShardSpec like the target's layers (TP
// heads and widths, EP experts); fc and the norms are replicated.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "model/layers.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

struct MtpHead {
  Linear fc;                                 // [hidden, 2 * hidden]: cat([embedding, hidden])
  std::vector<float> pre_fc_norm_embedding;  // [hidden]
  std::vector<float> pre_fc_norm_hidden;     // [hidden]
  DecoderLayer layer;                        // full attention at KV layer num_kv_cache_layers()
  std::vector<float> norm;                   // [hidden]
};

// The head's own tensors (its decoder layer's are plan_mtp_layer's, model/decoder_plan.h).
struct MtpTensors {
  std::string fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm;
};
MtpTensors mtp_tensors();

// Throws, naming the directory and the first missing tensor, unless `head` holds the whole head
// of `config`, one layer of it: the target checkpoint's own mtp.* (`own`) or a separate head
// directory's. Both backends check with it before loading.
void check_mtp_head(const ModelConfig& config, const Checkpoint& head, bool own);

// How many MTP layers `ckpt` holds: the distinct i of its mtp.layers.<i>.* tensors.
int count_mtp_layers(const Checkpoint& ckpt);

// Every tensor the head of `config` reads from a checkpoint, in load order (mtp.fc.weight first).
std::vector<std::string> mtp_tensor_names(const ModelConfig& config, const Checkpoint& ckpt);

// Loads MTP layer 0 of `ckpt` for `shard` (copied to fp32). Each tensor's shape is checked against
// `config`: a mismatch names the tensor, its file and both shapes. The caller (registry.cpp) has
// checked that every tensor exists.
MtpHead load_mtp_head(const ModelConfig& config, const Checkpoint& ckpt, const ShardSpec& shard);

}  // namespace relay
