// See mtp.h. The head's tensors sit at the top level of the checkpoint (mtp.*, never under
// model.language_model.), for the released Qwen3.5 / Qwen3-Next checkpoints and separate heads
// alike.
#include "model/mtp.h"

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

std::vector<std::string> mtp_tensor_names(const ModelConfig& c, const Checkpoint& ckpt) {
  std::vector<std::string> names = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                                    "mtp.pre_fc_norm_hidden.weight"};
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
  names.push_back("mtp.norm.weight");
  return names;
}

MtpHead load_mtp_head(const ModelConfig& c, const Checkpoint& ckpt, const ShardSpec& shard) {
  const bool zc = c.zero_centered_norms;
  MtpHead head;
  head.fc = load_linear(ckpt, {"mtp.fc"}, {c.hidden_size}, 2 * c.hidden_size, false);
  head.pre_fc_norm_embedding =
      load_norm(ckpt, "mtp.pre_fc_norm_embedding.weight", c.hidden_size, zc);
  head.pre_fc_norm_hidden = load_norm(ckpt, "mtp.pre_fc_norm_hidden.weight", c.hidden_size, zc);
  const LayerPlan lp = plan_mtp_layer(c);
  head.layer.input_norm = load_norm(ckpt, lp.input_norm(), c.hidden_size, zc);
  head.layer.mixer = std::make_unique<FullAttention>(c, ckpt, lp.attention(),
                                                     c.num_kv_cache_layers(), compute_rope(c), shard);
  head.layer.post_attention_norm = load_norm(ckpt, lp.post_attention_norm(), c.hidden_size, zc);
  head.layer.ffn = make_feed_forward(c, ckpt, lp, shard);
  head.norm = load_norm(ckpt, "mtp.norm.weight", c.hidden_size, zc);
  return head;
}

}  // namespace relay
