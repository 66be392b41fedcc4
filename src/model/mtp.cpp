// See mtp.h. The head's tensors sit at the top level of the checkpoint (mtp.*, never under
// model.language_model.), for the released Qwen3.5 / Qwen3-Next checkpoints and separate heads
// alike.
#include "model/mtp.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "core/error.h"
#include "model/rope.h"

namespace relay {

int count_mtp_layers(const Checkpoint& ckpt) {
  const std::string prefix = "mtp.layers.";
  std::set<int> layers;
  for (const std::string& name : ckpt.names()) {
    if (!name.starts_with(prefix)) continue;
    size_t end = prefix.size();
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end == prefix.size() || end == name.size() || name[end] != '.') continue;
    layers.insert(std::stoi(name.substr(prefix.size(), end - prefix.size())));
  }
  return static_cast<int>(layers.size());
}

MtpTensors mtp_tensors() {
  return {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
          "mtp.norm.weight"};
}

void check_mtp_head(const ModelConfig& config, const Checkpoint& head, bool own) {
  const std::string dir = head.dir().string();
  const int num_layers = count_mtp_layers(head);
  RELAY_CHECK(num_layers <= 1 && config.mtp_num_hidden_layers <= 1, "the MTP head in ", dir,
              " has ", std::max<int64_t>(num_layers, config.mtp_num_hidden_layers),
              " layers (mtp.layers.N, mtp_num_hidden_layers); Relay runs exactly one");
  for (const std::string& name : mtp_tensor_names(config, head)) {
    if (head.has(name)) continue;
    if (own) {
      fail(str("MTP was requested but the checkpoint ", dir, " has no tensor ", name,
               num_layers == 0 ? " (it ships no MTP head: Qwen3 / Qwen3-MoE checkpoints have none)"
                               : " (its MTP head is incomplete)",
               "; a separate MTP head directory (mtp.* tensors) is given with \"model\": DIR in "
               "the speculative config"));
    }
    fail(str("the MTP head directory ", dir, " has no tensor ", name, " (\"model\": DIR points at ",
             "a separate MTP head: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, "
             "mtp.norm and one decoder layer mtp.layers.0.* of the target's kind, ",
             config.architecture, ")"));
  }
}

std::vector<std::string> mtp_tensor_names(const ModelConfig& c, const Checkpoint& ckpt) {
  const MtpTensors head = mtp_tensors();
  std::vector<std::string> names = {head.fc, head.pre_fc_norm_embedding, head.pre_fc_norm_hidden};
  const LayerPlan lp = plan_mtp_layer(c);
  const std::string& p = lp.prefix;
  names.push_back(lp.input_norm());
  for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
    names.push_back(str(p, "self_attn.", proj, ".weight"));
    if (c.attention_bias) names.push_back(str(p, "self_attn.", proj, ".bias"));
  }
  names.push_back(p + "self_attn.q_norm.weight");
  names.push_back(p + "self_attn.k_norm.weight");
  names.push_back(lp.post_attention_norm());
  const std::string mlp = lp.mlp() + ".";
  if (lp.ffn != FfnKind::kDenseMlp) {
    names.push_back(mlp + "gate.weight");
    if (ckpt.has(mlp + "experts.gate_up_proj")) {
      names.push_back(mlp + "experts.gate_up_proj");
      names.push_back(mlp + "experts.down_proj");
    } else {
      for (int64_t e = 0; e < c.num_experts; ++e) {
        for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
          names.push_back(str(mlp, "experts.", e, ".", proj, ".weight"));
      }
    }
    if (lp.ffn == FfnKind::kMoeWithSharedExpert) {
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        names.push_back(str(mlp, "shared_expert.", proj, ".weight"));
      names.push_back(mlp + "shared_expert_gate.weight");
    }
  } else {
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
      names.push_back(str(mlp, proj, ".weight"));
  }
  names.push_back(head.norm);
  return names;
}

MtpHead load_mtp_head(const ModelConfig& c, const Checkpoint& ckpt, const ShardSpec& shard) {
  const bool zc = c.zero_centered_norms;
  const MtpTensors names = mtp_tensors();
  MtpHead head;
  head.fc.weight = load_f32(ckpt, names.fc, {c.hidden_size, 2 * c.hidden_size});
  head.fc.out_features = static_cast<int>(c.hidden_size);
  head.fc.in_features = static_cast<int>(2 * c.hidden_size);
  head.pre_fc_norm_embedding = load_norm(ckpt, names.pre_fc_norm_embedding, c.hidden_size, zc);
  head.pre_fc_norm_hidden = load_norm(ckpt, names.pre_fc_norm_hidden, c.hidden_size, zc);
  const LayerPlan lp = plan_mtp_layer(c);
  head.layer.input_norm = load_norm(ckpt, lp.input_norm(), c.hidden_size, zc);
  head.layer.mixer = std::make_unique<FullAttention>(c, ckpt, lp.attention(),
                                                     c.num_kv_cache_layers(), compute_rope(c), shard);
  head.layer.post_attention_norm = load_norm(ckpt, lp.post_attention_norm(), c.hidden_size, zc);
  head.layer.ffn = make_feed_forward(c, ckpt, lp, shard);
  head.norm = load_norm(ckpt, names.norm, c.hidden_size, zc);
  return head;
}

}  // namespace relay
