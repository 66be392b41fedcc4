// See node_group.h. Wire format: little-endian fixed-width fields and length-prefixed (uint32)
// arrays, in the order the encoders below write them; every message starts with a version byte so
// nodes of different builds fail clearly instead of misreading each other.
#include "engine/node_group.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "core/error.h"

namespace relay {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the node messages are written in host byte order, which is little-endian here");

// 2: prompt logprobs (a step's num_prompt_logprobs, a result's prompt_logprobs).
// 3: drafts (a sampling sequence's num_draft_tokens; a result's sampled tokens may hold several per
//    sequence, its accepted drafts then the token after them).
// 4: the recurrent state of hybrid models (a step's state slots, snapshot restore and saves).
// 5: MTP drafting on every node (a sampling sequence's wants-drafts flag, a result's drafts; a
//    chunk that does not sample carries the token after it).
constexpr uint8_t kWireVersion = 5;

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_array(std::span<const T> values) {
    put(static_cast<uint32_t>(values.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(values.data());
    bytes_.insert(bytes_.end(), p, p + values.size_bytes());
  }
  void put_string(const std::string& s) { put_array(std::span<const char>(s.data(), s.size())); }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}

  template <typename T>
  T get() {
    T v;
    need(sizeof(T));
    std::memcpy(&v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  // A count of items that take at least `min_bytes_each` bytes each, checked against what is left
  // (a corrupt count must fail here, not in a huge allocation).
  uint32_t get_count(size_t min_bytes_each) {
    const auto n = get<uint32_t>();
    need(size_t{n} * min_bytes_each);
    return n;
  }
  template <typename T>
  std::vector<T> get_array() {
    const uint32_t n = get<uint32_t>();
    need(size_t{n} * sizeof(T));
    std::vector<T> out(n);
    if (n > 0) std::memcpy(out.data(), bytes_.data() + at_, size_t{n} * sizeof(T));
    at_ += size_t{n} * sizeof(T);
    return out;
  }
  std::string get_string() {
    const std::vector<char> chars = get_array<char>();
    return {chars.begin(), chars.end()};
  }
  void expect_end() const {
    RELAY_CHECK(at_ == bytes_.size(), "node message: ", bytes_.size() - at_,
                " bytes left over after the last field");
  }

 private:
  void need(size_t n) const {
    RELAY_CHECK(n <= bytes_.size() - at_, "node message truncated: needs ", n, " more bytes at ",
                at_, " of ", bytes_.size());
  }
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

void check_version(Reader& r) {
  const auto v = r.get<uint8_t>();
  RELAY_CHECK(v == kWireVersion, "node message of wire version ", int{v}, ", this relay speaks ",
              int{kWireVersion}, ": start every node with the same relay build");
}

// The sampler reads a sequence's earlier tokens only for its penalties.
bool reads_history(const SamplingParams& p) {
  return p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

// A TokenLogprob on the wire: token, logprob, rank, then the count and pairs of its top tokens.
constexpr size_t kMinLogprobBytes = 2 * sizeof(int32_t) + sizeof(float) + sizeof(uint32_t);

void put_logprob(Writer& w, const TokenLogprob& t) {
  w.put(t.token);
  w.put(t.logprob);
  w.put(t.rank);
  w.put(static_cast<uint32_t>(t.top.size()));
  for (const auto& [token, logprob] : t.top) w.put(token), w.put(logprob);
}

void get_logprob(Reader& r, TokenLogprob& t) {
  t.token = r.get<int32_t>();
  t.logprob = r.get<float>();
  t.rank = r.get<int32_t>();
  t.top.resize(r.get_count(sizeof(int32_t) + sizeof(float)));
  for (auto& [token, logprob] : t.top) token = r.get<int32_t>(), logprob = r.get<float>();
}

}  // namespace

std::vector<uint8_t> encode_step(NodeCommand command, std::span<const StepSequence> batch,
                                 bool mtp) {
  Writer w;
  w.put(kWireVersion);
  w.put(command);
  w.put(static_cast<uint32_t>(batch.size()));
  for (const StepSequence& s : batch) {
    w.put(s.seq_id);
    w.put(s.num_computed);
    w.put_array(s.tokens);
    w.put_array(s.block_table);
    w.put(static_cast<uint8_t>(s.sample));
    w.put(s.num_prompt_logprobs);
    bool history = false;
    if (s.sample) {
      RELAY_CHECK(s.sampling != nullptr, "sequence ", s.seq_id,
                  " samples but has no SamplingParams");
      w.put(*s.sampling);
      w.put(s.sample_index);
      w.put(s.num_draft_tokens);
      w.put(static_cast<uint8_t>(s.proposed_drafts != nullptr));
      w.put(s.max_proposed_drafts);
      history = reads_history(*s.sampling);
      w.put_array(s.allowed_tokens);
      std::vector<int32_t> bias_tokens;
      std::vector<float> biases;
      for (const auto& [token, bias] : s.logit_bias) {
        bias_tokens.push_back(token);
        biases.push_back(bias);
      }
      w.put_array(std::span<const int32_t>(bias_tokens));
      w.put_array(std::span<const float>(biases));
    }
    std::span<const int32_t> prompt, output;
    if (history || s.num_prompt_logprobs >= 0) prompt = s.prompt_tokens;
    if (history) output = s.output_tokens;
    if (mtp && !s.sample) {
      // Index-preserving prefixes, up to and including the token after the chunk where known.
      const size_t next = static_cast<size_t>(s.num_computed) + s.tokens.size();
      const size_t num_prompt = s.prompt_tokens.size();
      if (prompt.empty()) prompt = s.prompt_tokens.first(std::min(next + 1, num_prompt));
      if (output.empty() && next >= num_prompt) {
        output = s.output_tokens.first(std::min(next + 1 - num_prompt, s.output_tokens.size()));
      }
    }
    w.put_array(prompt);
    w.put_array(output);
    w.put_array(s.state_slots);
    w.put(s.restore_state_snapshot);
    std::vector<int32_t> save_rows, save_ids;
    for (const SnapshotSave& save : s.save_state_snapshots) {
      save_rows.push_back(save.row);
      save_ids.push_back(save.snapshot);
    }
    w.put_array(std::span<const int32_t>(save_rows));
    w.put_array(std::span<const int32_t>(save_ids));
  }
  return w.take();
}

NodeStep decode_step(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  check_version(r);
  NodeStep step;
  step.command = r.get<NodeCommand>();
  const uint32_t n = r.get_count(sizeof(int64_t) + sizeof(int32_t));
  // The spans of `batch` point into these vectors: size them first so they never move.
  step.tokens.resize(n);
  step.block_tables.resize(n);
  step.prompt_tokens.resize(n);
  step.output_tokens.resize(n);
  step.sampling.resize(n);
  step.allowed_tokens.resize(n);
  step.logit_bias.resize(n);
  step.state_slots.resize(n);
  step.snapshot_saves.resize(n);
  step.proposed_drafts.resize(n);
  step.batch.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    StepSequence& s = step.batch[i];
    s.seq_id = r.get<int64_t>();
    s.num_computed = r.get<int32_t>();
    step.tokens[i] = r.get_array<int32_t>();
    step.block_tables[i] = r.get_array<int32_t>();
    s.tokens = step.tokens[i];
    s.block_table = step.block_tables[i];
    s.sample = r.get<uint8_t>() != 0;
    s.num_prompt_logprobs = r.get<int32_t>();
    RELAY_CHECK(s.num_prompt_logprobs >= -1, "node message: sequence ", s.seq_id,
                " has num_prompt_logprobs ", s.num_prompt_logprobs);
    if (s.sample) {
      step.sampling[i] = r.get<SamplingParams>();
      s.sampling = &step.sampling[i];
      s.sample_index = r.get<uint64_t>();
      s.num_draft_tokens = r.get<int32_t>();
      RELAY_CHECK(
          s.num_draft_tokens >= 0 && static_cast<size_t>(s.num_draft_tokens) < s.tokens.size(),
          "node message: sequence ", s.seq_id, " has ", s.num_draft_tokens, " drafts among its ",
          s.tokens.size(), " tokens");
      if (r.get<uint8_t>() != 0) s.proposed_drafts = &step.proposed_drafts[i];
      s.max_proposed_drafts = r.get<int32_t>();
      RELAY_CHECK(s.max_proposed_drafts >= 0, "node message: sequence ", s.seq_id, " asks for ",
                  s.max_proposed_drafts, " proposed drafts");
      step.allowed_tokens[i] = r.get_array<uint32_t>();
      RELAY_CHECK(
          step.allowed_tokens[i].size() % (1 + static_cast<size_t>(s.num_draft_tokens)) == 0,
          "node message: sequence ", s.seq_id, " has a token bitmask of ",
          step.allowed_tokens[i].size(), " words for ", 1 + s.num_draft_tokens, " sampled rows");
      s.allowed_tokens = step.allowed_tokens[i];
      const std::vector<int32_t> bias_tokens = r.get_array<int32_t>();
      const std::vector<float> biases = r.get_array<float>();
      RELAY_CHECK(bias_tokens.size() == biases.size(), "node message: sequence ", s.seq_id, " has ",
                  bias_tokens.size(), " logit_bias tokens for ", biases.size(), " biases");
      for (size_t k = 0; k < biases.size(); ++k) step.logit_bias[i].emplace_back(bias_tokens[k], biases[k]);
      s.logit_bias = step.logit_bias[i];
    }
    step.prompt_tokens[i] = r.get_array<int32_t>();
    step.output_tokens[i] = r.get_array<int32_t>();
    s.prompt_tokens = step.prompt_tokens[i];
    s.output_tokens = step.output_tokens[i];
    step.state_slots[i] = r.get_array<int32_t>();
    s.state_slots = step.state_slots[i];
    s.restore_state_snapshot = r.get<int32_t>();
    const std::vector<int32_t> save_rows = r.get_array<int32_t>(), save_ids = r.get_array<int32_t>();
    RELAY_CHECK(save_rows.size() == save_ids.size(), "node message: sequence ", s.seq_id, " has ",
                save_rows.size(), " state snapshot rows for ", save_ids.size(), " snapshots");
    for (size_t k = 0; k < save_rows.size(); ++k)
      step.snapshot_saves[i].push_back({save_rows[k], save_ids[k]});
    s.save_state_snapshots = step.snapshot_saves[i];
  }
  r.expect_end();
  return step;
}

std::vector<uint8_t> encode_result(const NodeResult& result) {
  Writer w;
  w.put(kWireVersion);
  w.put_string(result.error);
  w.put_array(std::span<const uint32_t>(result.seqs));
  w.put(static_cast<uint32_t>(result.sampled.size()));
  for (const SampledToken& t : result.sampled) {
    w.put(t.seq_id);
    put_logprob(w, t);
  }
  w.put(static_cast<uint32_t>(result.prompt_logprobs.size()));
  for (const std::vector<TokenLogprob>& rows : result.prompt_logprobs) {
    w.put(static_cast<uint32_t>(rows.size()));
    for (const TokenLogprob& t : rows) put_logprob(w, t);
  }
  w.put(static_cast<uint32_t>(result.drafts.size()));
  for (const std::vector<int32_t>& d : result.drafts) w.put_array(std::span<const int32_t>(d));
  w.put_array(std::span<const float>(result.logits));
  return w.take();
}

NodeResult decode_result(std::span<const uint8_t> bytes) {
  Reader r(bytes);
  check_version(r);
  NodeResult result;
  result.error = r.get_string();
  result.seqs = r.get_array<uint32_t>();
  result.sampled.resize(r.get_count(sizeof(int64_t) + kMinLogprobBytes));
  for (SampledToken& t : result.sampled) {
    t.seq_id = r.get<int64_t>();
    get_logprob(r, t);
  }
  result.prompt_logprobs.resize(r.get_count(sizeof(uint32_t)));
  for (std::vector<TokenLogprob>& rows : result.prompt_logprobs) {
    rows.resize(r.get_count(kMinLogprobBytes));
    for (TokenLogprob& t : rows) get_logprob(r, t);
  }
  result.drafts.resize(r.get_count(sizeof(uint32_t)));
  for (std::vector<int32_t>& d : result.drafts) d = r.get_array<int32_t>();
  result.logits = r.get_array<float>();
  r.expect_end();
  return result;
}

NodeGroup::NodeGroup(const parallel::NodeConfig& nodes, std::chrono::milliseconds setup_timeout,
                     std::chrono::milliseconds step_timeout)
    : config_(nodes),
      step_timeout_(step_timeout),
      bootstrap_(parallel::parse_dist_init(nodes.dist_init), nodes.node_rank, nodes.nnodes,
                 setup_timeout) {}

void NodeGroup::send(NodeCommand command, std::span<const StepSequence> batch, bool mtp) {
  RELAY_CHECK(config_.is_leader(), "only node 0 sends steps");
  const std::vector<uint8_t> bytes = encode_step(command, batch, mtp);
  bootstrap_.broadcast(bytes, step_timeout_);
}

std::vector<NodeResult> NodeGroup::gather(NodeResult mine) {
  RELAY_CHECK(config_.is_leader(), "only node 0 gathers step results");
  // The leader's own result stays in memory: it sends the bootstrap no blob of its own.
  std::vector<std::vector<uint8_t>> all = bootstrap_.gather({}, step_timeout_);
  std::vector<NodeResult> out;
  out.push_back(std::move(mine));
  for (size_t n = 1; n < all.size(); ++n) out.push_back(decode_result(all[n]));
  return out;
}

NodeStep NodeGroup::receive() {
  RELAY_CHECK(!config_.is_leader(), "node 0 does not receive steps");
  return decode_step(bootstrap_.broadcast({}, parallel::TcpBootstrap::kNoTimeout));
}

void NodeGroup::reply(const NodeResult& result) {
  bootstrap_.gather(encode_result(result), step_timeout_);
}

}  // namespace relay
