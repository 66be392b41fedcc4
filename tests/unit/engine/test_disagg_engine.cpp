// Disaggregated prefill and decode through two LLMEngines on real CPU backends: the prefill engine
// holds a finished prompt's KV (hold_kv), the layout mapper plans the copies between the two pools
// (which may be sharded differently: prefill TP 2 -> decode 1, prefill 1 -> decode DP 2), the
// transfer engine moves them, and the decode engine continues from the prefill's first token. The
// text must equal the colocated engine's, token for token. A hybrid model's recurrent state travels
// beside its KV (transfer/state_pool.h), from the prefill's held slot into the reservation's.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "engine/cpu_backend.h"
#include "engine/llm_engine.h"
#include "transfer/in_process_transport.h"
#include "transfer/layout_mapper.h"
#include "transfer/state_pool.h"
#include "transfer/transfer_engine.h"

namespace relay {
namespace {

const std::string kModel = RELAY_SOURCE_DIR "/models/relay-demo-moe";
// A trained Qwen3.5-MoE (Gated DeltaNet + gated attention): its recurrent state travels too.
const std::string kHybrid = RELAY_SOURCE_DIR "/models/relay-demo-hybrid";

// `mtp_drafts` > 0: the checkpoint's MTP head drafts that many tokens (relay-demo-hybrid has one).
std::unique_ptr<LLMEngine> make_engine(parallel::ParallelConfig p, int num_blocks,
                                       const std::string& model = kModel, int mtp_drafts = 0) {
  CpuBackendOptions o;
  o.block_size = 16;
  o.num_blocks = num_blocks;
  o.num_threads = 2;
  o.parallel = p;
  o.num_state_slots = 8 * (1 + mtp_drafts);
  EngineConfig ec;
  ec.max_num_seqs = 8;
  ec.max_num_batched_tokens = 256;
  if (mtp_drafts > 0) {
    o.mtp = {.enabled = true};
    o.num_mtp_drafts = mtp_drafts;
    ec.speculative.method = SpeculativeConfig::Method::kMtp;
    ec.speculative.num_speculative_tokens = mtp_drafts;
  }
  return std::make_unique<LLMEngine>(std::make_unique<CpuBackend>(model, o),
                                     Tokenizer::from_model_dir(model), ec);
}

EngineRequest request(const LLMEngine& e, const std::string& prompt, int64_t max_tokens) {
  EngineRequest r;
  r.prompt = e.tokenizer().encode(prompt);
  r.sampling.temperature = 0.0f;
  r.stop.max_tokens = max_tokens;
  r.stop.ignore_eos = true;
  return r;
}

// The engine's KV pools (and a hybrid model's state pools) as the transfer side of the DP group
// `dp_rank`, registered with `engine` under ids from `first_region` (state pools from
// first_region + 5).
struct Side {
  std::vector<KvPoolDesc> pools;
  int num_kv_heads = 0;
  std::vector<StatePoolDesc> states;
  int num_k_heads = 0, num_v_heads = 0;
  int slots_per_rank = 0;
};
Side register_side(CpuBackend& backend, int dp_rank, TransferEngine& engine,
                   RegionId first_region) {
  Side side;
  const ModelConfig& c = backend.config();
  side.num_kv_heads = static_cast<int>(c.num_key_value_heads);
  const std::vector<KvPoolExport> pools = backend.kv_pool_exports();
  for (size_t r = 0; r < pools.size(); ++r) {
    const KvPoolExport& p = pools[r];
    if (p.dp_rank != dp_rank) continue;
    const KvCacheLayout& l = p.layout;
    const RegionId id = first_region + static_cast<RegionId>(r);
    engine.register_region(id, p.base, l.total_bytes());
    side.pools.push_back(contiguous_kv_pool(l.num_layers, l.num_blocks, l.block_size, l.head_dim,
                                            l.element_bytes, {p.first_kv_head, p.num_kv_heads},
                                            id));
  }
  const std::vector<StatePoolExport> states = backend.state_pool_exports();
  for (size_t r = 0; r < states.size(); ++r) {
    const StatePoolExport& p = states[r];
    if (p.dp_rank != dp_rank) continue;
    const RegionId id = first_region + 5 + static_cast<RegionId>(r);
    engine.register_region(id, p.base, p.layout.total_bytes());
    side.states.push_back(state_pool_for(p.layout, {p.first_k_head, p.num_k_heads},
                                         {p.first_v_head, p.num_v_heads}, id, 0));
  }
  side.num_k_heads = static_cast<int>(c.linear_num_key_heads);
  side.num_v_heads = static_cast<int>(c.linear_num_value_heads);
  side.slots_per_rank = backend.num_state_slots() / backend.num_kv_partitions();
  return side;
}

std::map<std::string, std::string> colocated(const std::vector<std::string>& prompts,
                                             int max_tokens, const std::string& model,
                                             SpecDecodeStats* spec = nullptr, int mtp_drafts = 0) {
  auto engine = make_engine({}, 64, model, mtp_drafts);
  for (size_t i = 0; i < prompts.size(); ++i)
    engine->add_request(static_cast<int64_t>(i), request(*engine, prompts[i], max_tokens));
  std::map<std::string, std::string> text;
  while (engine->has_work()) {
    for (const RequestOutput& o : engine->step()) text[prompts[o.id]] += o.text;
  }
  if (spec != nullptr) *spec = engine->stats().spec_decode;
  return text;
}

const std::vector<std::string> kPrompts = {
    "def fibonacci(n):", "import os\nimport sys\n\ndef main(argv):",
    "class Stack:\n    def __init__(self):"};

// Runs `prompts` disaggregated and checks the text; returns how many prompt tokens the decode side
// already held (its prefix cache) over all requests.
// With `mtp_drafts`, both sides load the MTP head: the prefill computes the head's K/V of the prompt
// (one more KV layer, moved with the others) and the decode side drafts from it; its acceptance
// goes to *spec.
int disaggregated(parallel::ParallelConfig prefill_p, parallel::ParallelConfig decode_p,
                  const std::vector<std::string>& prompts = kPrompts,
                  const std::string& model = kModel, int mtp_drafts = 0,
                  SpecDecodeStats* spec = nullptr) {
  const int kMaxTokens = 24;
  int reused = 0;
  const auto want = colocated(prompts, kMaxTokens, model);

  auto prefill = make_engine(prefill_p, 32, model, mtp_drafts);
  auto decode = make_engine(decode_p, 32, model, mtp_drafts);
  auto& prefill_backend = static_cast<CpuBackend&>(prefill->backend());
  auto& decode_backend = static_cast<CpuBackend&>(decode->backend());
  TransferEngine prefill_transfer(make_in_process_transport()),
      decode_transfer(make_in_process_transport());
  const Side src = register_side(prefill_backend, 0, prefill_transfer, 100);
  std::vector<Side> dst;
  for (int d = 0; d < decode_p.dp; ++d)
    dst.push_back(register_side(decode_backend, d, decode_transfer, 200 + 10 * d));
  for (const Side& side : dst) {
    for (const KvPoolDesc& pool : side.pools) {
      prefill_transfer.import_region(decode_transfer.descriptor(pool.k.front().region));
    }
    for (const StatePoolDesc& pool : side.states)
      prefill_transfer.import_region(decode_transfer.descriptor(pool.region));
  }

  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r = request(*prefill, prompts[i], kMaxTokens);
    EngineRequest first_only = r;
    first_only.stop.max_tokens = 1;
    first_only.hold_kv = true;
    const int64_t id = static_cast<int64_t>(i) + 1;
    prefill->add_request(id, first_only);
    RequestOutput done;
    while (prefill->has_work()) {
      for (RequestOutput& o : prefill->step()) done = o;
    }
    EXPECT_EQ(done.new_tokens.size(), 1u);
    if (done.kv_blocks.empty()) {
      ADD_FAILURE() << "no held blocks";
      return reused;
    }

    const auto reserved = decode->reserve_kv(id, r.prompt);
    EXPECT_TRUE(reserved.has_value());
    if (!reserved) return reused;
    reused += reserved->num_cached_tokens;
    const int d = decode->kv_partition(id);
    std::vector<int32_t> local = reserved->block_table;
    for (int32_t& b : local) b -= d * (decode_backend.num_kv_blocks() / decode_p.dp);
    const KvTransferSide s{src.num_kv_heads, src.pools, done.kv_blocks};
    const KvTransferSide t{dst[d].num_kv_heads, dst[d].pools, local};
    // Only the part the decode side does not hold yet moves.
    auto copies =
        plan_kv_copies(s, t, {reserved->num_cached_tokens, static_cast<int64_t>(r.prompt.size())});
    // A hybrid model's state after the prompt: the prefill's held slot into the reservation's.
    EXPECT_EQ(done.state_slot >= 0, !src.states.empty());
    EXPECT_EQ(reserved->state_slot >= 0, !src.states.empty());
    if (!src.states.empty()) {
      const StateTransferSide from{src.num_k_heads, src.num_v_heads, src.states, done.state_slot};
      const StateTransferSide to{dst[d].num_k_heads, dst[d].num_v_heads, dst[d].states,
                                 reserved->state_slot - d * dst[d].slots_per_rank};
      const std::vector<KvCopy> state_copies = plan_state_copies(from, to);
      copies.insert(copies.end(), state_copies.begin(), state_copies.end());
    }
    const TransferResult result = prefill_transfer.submit({id, transfer_copies(copies), {}}).get();
    EXPECT_EQ(result.status, TransferStatus::Ok) << result.reason;
    prefill->release_kv(id);
    EXPECT_EQ(prefill->num_held_kv(), 0);

    SampledToken first;
    first.token = done.new_tokens[0];
    RequestOutput out = decode->add_prefilled_request(id, r, first, 0);
    std::string text = out.text;
    while (decode->has_work()) {
      for (const RequestOutput& o : decode->step()) text += o.text;
    }
    EXPECT_EQ(text, want.at(prompts[i])) << prompts[i] << " with prefill " << prefill_p.describe()
                                         << " -> decode " << decode_p.describe();
  }
  EXPECT_EQ(decode->stats().kv_cache_usage, 0.0);
  if (spec != nullptr) *spec = decode->stats().spec_decode;
  return reused;
}

TEST(DisaggEngine, PrefillHandsKvToDecodeOneRankEach) { EXPECT_EQ(disaggregated({}, {}), 0); }
TEST(DisaggEngine, PrefillTp2ToDecodeOneRank) { disaggregated({2, 2, 1}, {}); }
TEST(DisaggEngine, PrefillOneRankToDecodeDp2Ep2) { disaggregated({}, {1, 2, 2}); }

// The hybrid's recurrent state moves with the KV, re-sharded like it (TP 2 splits the Gated
// DeltaNet heads; a DP 2 decode worker's state lives on the reservation's rank).
TEST(DisaggEngine, HybridPrefillHandsKvAndStateToDecodeOneRankEach) {
  EXPECT_EQ(disaggregated({}, {}, kPrompts, kHybrid), 0);
}
TEST(DisaggEngine, HybridPrefillTp2ToDecodeDp2Ep2) { disaggregated({2, 2, 1}, {1, 2, 2}, kPrompts, kHybrid); }
TEST(DisaggEngine, HybridPrefillOneRankToDecodeTp2) { disaggregated({}, {2, 1, 1}, kPrompts, kHybrid); }

// MTP on both roles: the head's K/V of the prompt travels as one more KV layer, so the decode side
// drafts as a colocated engine does — the same acceptance within the first step's drafts (the
// decode side's first step has none); a head attending over unsent K/V drafts far worse.
TEST(DisaggEngine, HybridWithMtpHandsTheHeadsKvToo) {
  SpecDecodeStats want_spec, got_spec;
  colocated(kPrompts, 24, kHybrid, &want_spec, 2);
  for (const auto& [prefill_p, decode_p] :
       {std::pair<parallel::ParallelConfig, parallel::ParallelConfig>{{}, {}},
        {{2, 2, 1}, {1, 2, 2}}}) {
    disaggregated(prefill_p, decode_p, kPrompts, kHybrid, 2, &got_spec);
    ASSERT_GT(want_spec.num_draft_tokens, 0u);
    ASSERT_GT(got_spec.num_draft_tokens, 0u);
    const double want = double(want_spec.num_accepted_tokens) / want_spec.num_draft_tokens,
                 got = double(got_spec.num_accepted_tokens) / got_spec.num_draft_tokens;
    // (0.655 against 0.667 here; without the head's K/V layer in the copies, 0.557.)
    EXPECT_NEAR(got, want, 0.05) << prefill_p.describe() << " -> " << decode_p.describe();
  }
}

TEST(DisaggEngine, ASharedPrefixTheDecodeSideHoldsIsNotSentAgain) {
  const std::string prefix =
      "import numpy as np\nimport torch\n\n\nclass Model(torch.nn.Module):\n    def __init__(self, "
      "dim):\n"
      "        super().__init__()\n        self.dim = dim\n\n    def forward(self, x):\n";
  const int reused =
      disaggregated({}, {}, {prefix + "        return x", prefix + "        y = x * 2"});
  EXPECT_GE(reused, 32);  // the second request found the first's full blocks
}

TEST(DisaggEngine, ReservationsRespectCapacityAndRelease) {
  auto decode = make_engine({}, 4);  // 4 blocks of 16 tokens
  const std::vector<int32_t> prompt(40, 7);
  EXPECT_TRUE(decode->reserve_kv(1, prompt).has_value());  // 3 blocks
  EXPECT_FALSE(decode->reserve_kv(2, prompt).has_value());
  decode->release_kv(1);
  EXPECT_TRUE(decode->reserve_kv(2, prompt).has_value());
  EngineRequest r;
  r.prompt = {1, 2, 3};
  SampledToken first;
  EXPECT_THROW(decode->add_prefilled_request(3, r, first, 0), Error);  // no reservation
}

}  // namespace
}  // namespace relay
