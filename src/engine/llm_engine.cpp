// One engine step: schedule, run the backend, turn sampled ids into text and stop decisions
// (see llm_engine.h).
#include "engine/llm_engine.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace relay {

using Clock = std::chrono::steady_clock;

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return "";
}

struct LLMEngine::Request {
  Request(int64_t id, StopConditions stop_conditions, const Tokenizer& tokenizer, bool logprobs)
      : id(id),
        stop(std::move(stop_conditions)),
        want_logprobs(logprobs),
        detokenizer(tokenizer, stop.skip_special_tokens) {
    for (const std::string& s : stop.stop_strings) max_stop_len = std::max(max_stop_len, s.size());
  }

  int64_t id;
  StopConditions stop;
  bool want_logprobs;
  bool hold_kv = false;
  int num_prompt_logprobs = -1;
  bool prompt_logprobs_due = false;  // asked for and not yet delivered
  // By prompt position ([0] stays empty) while the prompt is computed.
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  // Token constraints. The grammar is kWaiting inside the model's reasoning block, kActive while it
  // constrains, kDone once a stop token completed it.
  enum class GrammarPhase { kNone, kWaiting, kActive, kDone };
  GrammarPhase grammar_phase = GrammarPhase::kNone;
  std::optional<GrammarMatcher> matcher;
  // The matcher's allowed tokens for the next sample (with drafts, one bitmask per sampled row).
  std::vector<uint32_t> bitmask;
  ReasoningTokens reasoning;
  std::vector<std::pair<int32_t, float>> logit_bias;
  IncrementalDetokenizer detokenizer;
  // What a decode with drafts computes (its StepSequence::tokens): its last token, then the drafts.
  std::vector<int32_t> step_tokens;
  std::vector<int32_t> proposed_drafts;  // from the backend's draft head (MTP), for the next step
  // With min_draft_acceptance: how many drafts its steps carry (the MTP head proposes at most
  // that many: StepSequence::max_proposed_drafts).
  std::optional<DraftLength> draft_length;
  std::string text;     // the output text so far
  size_t num_sent = 0;  // bytes of `text` already returned
  size_t max_stop_len = 0;
  Clock::time_point arrival = Clock::now();
  std::optional<Clock::time_point> first_scheduled;
};

namespace {

// The recurrent-state slots of a hybrid model's backend (null when it has none): each sequence
// takes its state slot and one scratch slot per draft position.
std::unique_ptr<StateSlotManager> make_state_slots(const Backend& backend,
                                                   const EngineConfig& config) {
  const int num_slots = backend.num_state_slots();
  if (num_slots == 0) return nullptr;
  const int per_sequence =
      1 + (config.speculative.enabled() ? config.speculative.num_speculative_tokens : 0);
  const int partitions = backend.num_kv_partitions();
  RELAY_CHECK(num_slots % partitions == 0 && num_slots / partitions >= per_sequence,
              "the backend's ", num_slots, " recurrent-state slots do not give each of its ",
              partitions, " partitions room for one sequence's ", per_sequence,
              " slots (1 + num_speculative_tokens)");
  return std::make_unique<StateSlotManager>(num_slots, per_sequence, partitions);
}

// The state snapshots of a hybrid model's prefix cache (null when it has none or caching is off).
std::unique_ptr<StateSnapshotPool> make_state_snapshots(const Backend& backend,
                                                        const EngineConfig& config) {
  const int num_snapshots = backend.num_state_snapshots();
  if (backend.num_state_slots() == 0 || num_snapshots == 0 || !config.enable_prefix_caching) {
    return nullptr;
  }
  return std::make_unique<StateSnapshotPool>(num_snapshots, backend.num_kv_partitions());
}

}  // namespace

LLMEngine::LLMEngine(std::unique_ptr<Backend> backend, Tokenizer tokenizer,
                     const EngineConfig& config)
    : backend_(std::move(backend)),
      tokenizer_(std::move(tokenizer)),
      max_model_len_(0),
      // NOTE: a recurrent layer's state is built from every token, so a hybrid model caches a
      // prefix only with state snapshots to restore it from (scheduler.h).
      blocks_(backend_->num_kv_blocks(), backend_->block_size(),
              config.enable_prefix_caching &&
                  (backend_->num_state_slots() == 0 || backend_->num_state_snapshots() > 0),
              backend_->num_kv_partitions()),
      states_(make_state_slots(*backend_, config)),
      snapshots_(make_state_snapshots(*backend_, config)),
      scheduler_({.max_num_seqs = config.max_num_seqs,
                  .max_num_batched_tokens = config.max_num_batched_tokens,
                  .num_lookahead_tokens = std::max(0, backend_->num_proposed_drafts() - 1),
                  .hit_drops_last_block = backend_->num_proposed_drafts() > 0},
                 blocks_, states_.get(), snapshots_.get()) {
  const int64_t model_len = backend_->config().max_position_embeddings;
  int64_t len = config.max_model_len > 0 ? config.max_model_len : model_len;
  RELAY_CHECK(model_len <= 0 || len <= model_len, "max_model_len ", len,
              " exceeds the model's max_position_embeddings ", model_len);
  // NOTE: one request must always fit in the pool on its own (the scheduler's progress guarantee),
  // so the context is capped by the capacity of one partition (a DP rank's pool).
  len = std::min<int64_t>(
      len, static_cast<int64_t>(blocks_.blocks_per_partition()) * blocks_.block_size());
  max_model_len_ = static_cast<int>(len);
  RELAY_CHECK(max_model_len_ >= 2, "max_model_len ", max_model_len_, " leaves no room to generate");
  speculative_ = config.speculative;
  if (speculative_.enabled()) {
    RELAY_CHECK(backend_->supports_draft_tokens(), "--speculative-config ",
                speculative_.describe(), ": this backend does not verify drafts (the CPU backend "
                "does, and the CUDA backend when sized for them)");
    const bool mtp = speculative_.method == SpeculativeConfig::Method::kMtp;
    RELAY_CHECK(backend_->num_proposed_drafts() == (mtp ? speculative_.num_speculative_tokens : 0),
                "--speculative-config ", speculative_.describe(), ": the backend proposes ",
                backend_->num_proposed_drafts(), " drafts per step; ",
                mtp ? "load it with the MTP head and the same num_speculative_tokens"
                    : "an n-gram engine needs a backend without a draft head");
    spec_stats_.num_accepted_tokens_per_pos.assign(
        static_cast<size_t>(speculative_.num_speculative_tokens), 0);
  }
}

LLMEngine::~LLMEngine() = default;

void LLMEngine::validate(int64_t id, const EngineRequest& request) const {
  RELAY_CHECK(!request.prompt.empty(), "request ", id, " has an empty prompt");
  RELAY_CHECK(requests_.count(id) == 0, "request id ", id, " is already in use");
  const int64_t vocab = backend_->config().vocab_size;
  for (int32_t t : request.prompt) {
    RELAY_CHECK(t >= 0 && t < vocab, "prompt token ", t, " is outside the vocabulary [0, ", vocab,
                ")");
  }
  for (const std::string& s : request.stop.stop_strings) {
    RELAY_CHECK(!s.empty(), "request ", id, " has an empty stop string");
  }
  RELAY_CHECK(request.num_prompt_logprobs >= -1,
              "num_prompt_logprobs must be -1 (none) or at least 0, got ",
              request.num_prompt_logprobs);
  const bool constrains = request.grammar != nullptr || !request.logit_bias.empty();
  RELAY_CHECK(!constrains || backend_->supports_token_constraints(), "request ", id,
              " has a grammar or a logit_bias, which this backend does not apply");
  for (const auto& [token, bias] : request.logit_bias) {
    RELAY_CHECK(token >= 0 && token < vocab, "logit_bias token ", token,
                " is outside the vocabulary [0, ", vocab, ")");
    RELAY_CHECK(std::isfinite(bias), "logit_bias of token ", token, " is not finite");
  }
  const bool scores_prompt = request.num_prompt_logprobs >= 0;
  RELAY_CHECK(!scores_prompt || backend_->supports_prompt_logprobs(), "request ", id,
              " asks for prompt logprobs (num_prompt_logprobs ", request.num_prompt_logprobs,
              "), which this backend does not compute");
  // NOTE: max_tokens 0 is vLLM's scoring request (echo with prompt logprobs): nothing to sample.
  RELAY_CHECK(request.stop.max_tokens >= (scores_prompt ? 0 : 1), "max_tokens must be at least ",
              scores_prompt ? "0" : "1 (0 only with prompt logprobs)", ", got ",
              request.stop.max_tokens);
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.stop.max_tokens;
  RELAY_CHECK(total <= max_model_len_, "prompt (", request.prompt.size(),
              " tokens) plus max_tokens (", request.stop.max_tokens, ") exceeds max_model_len ",
              max_model_len_);
}

std::unique_ptr<LLMEngine::Request> LLMEngine::make_request(int64_t id,
                                                            EngineRequest& request) const {
  auto r = std::make_unique<Request>(id, std::move(request.stop), tokenizer_,
                                     request.sampling.num_logprobs >= 0);
  r->hold_kv = request.hold_kv;
  r->logit_bias = std::move(request.logit_bias);
  if (speculative_.min_draft_acceptance > 0) {
    r->draft_length.emplace(speculative_.num_speculative_tokens, speculative_.min_draft_acceptance);
  }
  r->reasoning = request.reasoning;
  if (request.grammar) {
    r->matcher.emplace(*request.grammar);
    const int64_t vocab = backend_->config().vocab_size;
    RELAY_CHECK(r->matcher->vocab_size() == vocab, "request ", id, ": its grammar covers ",
                r->matcher->vocab_size(), " tokens, the model ", vocab);
    r->grammar_phase = request.reasoning.starts_inside ? Request::GrammarPhase::kWaiting
                                                       : Request::GrammarPhase::kActive;
  }
  return r;
}

void LLMEngine::add_request(int64_t id, EngineRequest request) {
  validate(id, request);
  RELAY_CHECK(held_kv_.count(id) == 0, "request id ", id, " still holds KV blocks");
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->tokens = std::move(request.prompt);
  seq->sampling = request.sampling;
  seq->wants_prompt_logprobs = request.num_prompt_logprobs >= 0;
  seq->prompt_only = request.stop.max_tokens == 0;
  std::unique_ptr<Request> r = make_request(id, request);
  if (seq->wants_prompt_logprobs) {
    r->num_prompt_logprobs = request.num_prompt_logprobs;
    r->prompt_logprobs_due = true;
    r->prompt_logprobs.resize(seq->tokens.size());
  }
  requests_.emplace(id, std::move(r));
  scheduler_.add(std::move(seq));
}

std::optional<LLMEngine::KvReservation> LLMEngine::reserve_kv(int64_t id,
                                                              std::span<const int32_t> prompt) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  RELAY_CHECK(n >= 1 && n < max_model_len_, "a KV reservation of ", n,
              " tokens does not fit max_model_len ", max_model_len_);
  RELAY_CHECK(requests_.count(id) == 0 && !blocks_.has_sequence(id), "request id ", id,
              " is already in use");
  if (scheduler_.num_running() + num_held_kv() >= scheduler_.config().max_num_seqs)
    return std::nullopt;
  // NOTE: a hybrid model's reservation takes no prefix hit: the prefill worker sends the state
  // after the whole prompt, and the KV of the whole prompt with it. Nor does one with an MTP head:
  // the head's K/V at a hit's last position depends on the token after it (the scheduler gives
  // that block back, hit_drops_last_block); the prefill worker computed it with the right one.
  const bool whole_prompt = states_ != nullptr || backend_->num_proposed_drafts() > 0;
  const PrefixHit hit = whole_prompt ? PrefixHit{} : blocks_.find_cached_prefix(prompt);
  if (!blocks_.allocate(id, n, &hit)) return std::nullopt;
  if (states_ != nullptr && !states_->allocate(id, blocks_.partition_of(id))) {
    blocks_.free(id);
    return std::nullopt;
  }
  held_kv_.insert(id);
  const auto table = blocks_.block_table(id);
  return KvReservation{{table.begin(), table.end()},
                       static_cast<int>(hit.num_tokens(blocks_.block_size())), state_slot(id)};
}

int32_t LLMEngine::state_slot(int64_t id) const {
  if (states_ == nullptr) return -1;
  const std::span<const int32_t> slots = states_->slots(id);
  return slots.empty() ? -1 : slots.front();
}

RequestOutput LLMEngine::add_prefilled_request(int64_t id, EngineRequest request,
                                               const SampledToken& first, int num_cached_tokens) {
  RELAY_CHECK(held_kv_.count(id) == 1 && blocks_.has_sequence(id), "request ", id,
              " has no KV reservation");
  RELAY_CHECK(request.num_prompt_logprobs < 0, "request ", id,
              ": prompt logprobs are computed where the prompt is prefilled, a prefilled request "
              "cannot ask for them (num_prompt_logprobs ",
              request.num_prompt_logprobs, ")");
  validate(id, request);
  const int64_t n = static_cast<int64_t>(request.prompt.size());
  RELAY_CHECK(static_cast<int64_t>(blocks_.block_table(id).size()) * blocks_.block_size() >= n,
              "request ", id, ": its reservation does not cover the ", n, "-token prompt");
  RELAY_CHECK(first.token >= 0 && first.token < backend_->config().vocab_size, "first token ",
              first.token, " is outside the vocabulary");
  std::unique_ptr<Request> r = make_request(id, request);
  // The grammar goes on from after the first token, which the prefill worker sampled under its
  // mask; checked before anything is committed, so a refusal leaves the reservation as it was.
  RELAY_CHECK(!r->matcher || advance_grammar(*r, first.token, /*first_output=*/true), "request ",
              id, ": its grammar refuses the first token ", first.token);
  auto seq = std::make_unique<Sequence>();
  seq->id = id;
  seq->tokens = std::move(request.prompt);
  seq->num_prompt_tokens = static_cast<int>(n);
  seq->num_computed = static_cast<int>(n);
  seq->num_cached_prompt_tokens = num_cached_tokens;
  seq->sampling = request.sampling;
  seq->tokens.push_back(first.token);
  blocks_.cache_full_blocks(id, seq->tokens, n);  // the received prompt serves later prefixes too
  held_kv_.erase(id);
  scheduler_.add_running(std::move(seq));
  r->first_scheduled = r->arrival;
  Request& req = *r;
  requests_.emplace(id, std::move(r));
  RequestOutput out;
  out.id = id;
  SampledToken t = first;
  t.seq_id = id;
  on_token(req, t, out);
  if (out.finish != FinishReason::kNone) {
    scheduler_.finish(id);
    requests_.erase(id);
  }
  return out;
}

void LLMEngine::release_kv(int64_t id) {
  if (held_kv_.erase(id) == 0) return;
  blocks_.free(id);
  if (states_ != nullptr) states_->free(id);
}

std::optional<RequestOutput> LLMEngine::abort(int64_t id) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) return std::nullopt;
  RequestOutput out;
  out.id = id;
  if (const Sequence* seq = scheduler_.find(id)) {
    out.num_prompt_tokens = seq->num_prompt_tokens;
    out.num_output_tokens = seq->num_output_tokens();
    out.num_cached_tokens = std::max(0, seq->num_cached_prompt_tokens);
  }
  out.finish = FinishReason::kAbort;
  scheduler_.finish(id);
  requests_.erase(it);
  return out;
}

EngineStats LLMEngine::stats() const {
  return {scheduler_.num_running(), scheduler_.num_waiting(), blocks_.usage(),
          states_ != nullptr ? states_->usage() : 0.0, scheduler_.stats(), spec_stats_,
          snapshots_ != nullptr ? snapshots_->num_cached() : 0};
}

bool LLMEngine::drafting() const {
  return speculative_.disable_by_batch_size == 0 ||
         scheduler_.num_running() <= speculative_.disable_by_batch_size;
}

void LLMEngine::propose_drafts() {
  for (Sequence* seq : scheduler_.running()) {
    // Only a decode (its last sampled token not yet computed) can carry drafts, and drafts given
    // through set_drafts for this step come first.
    if (static_cast<int>(seq->tokens.size()) - seq->num_computed != 1) continue;
    if (!seq->draft_tokens.empty()) continue;
    const int k = next_drafts(*requests_.at(seq->id));
    if (k == 0) continue;
    set_drafts(seq->id, propose_ngram(seq->tokens, speculative_.prompt_lookup_min,
                                      speculative_.prompt_lookup_max, k));
  }
}

std::vector<RequestOutput> LLMEngine::step() {
  last_step_ = {};
  if (!scheduler_.has_work()) return {};
  const Clock::time_point start = Clock::now();
  if (drafting()) {
    if (speculative_.method == SpeculativeConfig::Method::kNgram) propose_drafts();
  } else {  // a batch past disable_by_batch_size: the MTP head's drafts from the last step go too
    for (Sequence* seq : scheduler_.running()) seq->draft_tokens.clear();
  }
  const SchedulerOutput plan = scheduler_.schedule();
  if (plan.empty()) return {};
  // NOTE: a step that fails before update() hands its plan's state snapshots back (the server
  // then fails every request and carries on with a clean engine).
  struct AbandonUnlessUpdated {
    Scheduler& scheduler;
    const SchedulerOutput& plan;
    bool updated = false;
    ~AbandonUnlessUpdated() {
      if (!updated) scheduler.abandon(plan);
    }
  } abandon{scheduler_, plan};
  last_step_ = {static_cast<int>(plan.chunks.size()), plan.num_batched_tokens};
  std::unordered_map<int64_t, int> drafts_verified;  // by request, for the spec-decode counters
  for (const ScheduledChunk& c : plan.chunks) {
    last_step_.num_draft_tokens += c.num_draft_tokens;
    if (c.sample) drafts_verified[c.seq->id] = c.num_draft_tokens;
  }
  const Clock::time_point now = Clock::now();
  last_step_.schedule_s = std::chrono::duration<double>(now - start).count();
  std::vector<StepSequence> batch;
  batch.reserve(plan.chunks.size());
  // The backend's prompt logprob rows of the chunks that ask (by batch index; empty when none).
  std::vector<std::vector<TokenLogprob>> prompt_rows;
  for (const ScheduledChunk& c : plan.chunks) {
    Request& r = *requests_.at(c.seq->id);
    if (!r.first_scheduled) r.first_scheduled = now;
    StepSequence s;
    s.seq_id = c.seq->id;
    const auto drafts = std::span<const int32_t>(c.seq->draft_tokens).first(c.num_draft_tokens);
    if (drafts.empty()) {
      s.tokens = std::span<const int32_t>(c.seq->tokens).subspan(c.seq->num_computed, c.num_tokens);
    } else {
      r.step_tokens.assign(1, c.seq->tokens.back());
      r.step_tokens.insert(r.step_tokens.end(), drafts.begin(), drafts.end());
      s.tokens = r.step_tokens;
      s.num_draft_tokens = c.num_draft_tokens;
    }
    s.num_computed = c.seq->num_computed;
    s.block_table = blocks_.block_table(c.seq->id);
    if (states_ != nullptr) s.state_slots = states_->slots(c.seq->id);
    s.restore_state_snapshot = c.restore_snapshot;
    s.save_state_snapshots = c.snapshot_saves;
    s.sample = c.sample;
    s.sampling = &c.seq->sampling;
    s.output_tokens = c.seq->output_tokens();
    s.prompt_tokens = std::span<const int32_t>(c.seq->tokens).first(c.seq->num_prompt_tokens);
    s.sample_index = static_cast<uint64_t>(c.seq->num_output_tokens());
    if (r.prompt_logprobs_due) {
      if (prompt_rows.empty()) prompt_rows.resize(plan.chunks.size());
      s.num_prompt_logprobs = r.num_prompt_logprobs;
      s.prompt_logprobs = &prompt_rows[batch.size()];
    }
    if (c.sample && backend_->num_proposed_drafts() > 0) {
      r.proposed_drafts.clear();
      s.max_proposed_drafts = next_drafts(r);
      if (s.max_proposed_drafts > 0) s.proposed_drafts = &r.proposed_drafts;
    }
    if (c.sample) {
      // NOTE: set_drafts kept only drafts the grammar allows, from the state it is still in.
      RELAY_CHECK(
          walk_grammar(r, drafts, c.seq->num_output_tokens() == 0, &r.bitmask) == drafts.size(),
          "request ", r.id, ": its grammar refuses a draft set_drafts accepted");
      s.allowed_tokens = r.bitmask;
      s.logit_bias = r.logit_bias;
    }
    batch.push_back(s);
  }
  const Clock::time_point forward_start = Clock::now();
  const std::vector<SampledToken> sampled = backend_->step(batch);
  const Clock::time_point forward_end = Clock::now();
  last_step_.schedule_s += std::chrono::duration<double>(forward_start - now).count();
  last_step_.forward_s = std::chrono::duration<double>(forward_end - forward_start).count();
  // Before update(), which may grow the token lists the batch's spans point into.
  for (const StepSequence& s : batch) {
    if (s.prompt_logprobs != nullptr) keep_prompt_logprobs(*requests_.at(s.seq_id), s);
  }
  abandon.updated = true;
  scheduler_.update(plan, sampled);

  std::vector<RequestOutput> outputs;
  outputs.reserve(sampled.size());
  // A request's committed tokens are consecutive: its accepted drafts, then the token after them.
  for (size_t i = 0; i < sampled.size();) {
    Request& r = *requests_.at(sampled[i].seq_id);
    size_t n = 1;
    while (i + n < sampled.size() && sampled[i + n].seq_id == r.id) ++n;
    if (const int k = drafts_verified.at(r.id); k > 0) {
      count_drafts(k, static_cast<int>(n) - 1);
      if (r.draft_length) r.draft_length->observe(k, static_cast<int>(n) - 1);
    }
    const int num_outputs = scheduler_.find(r.id)->num_output_tokens();
    RequestOutput out;
    out.id = r.id;
    // Token by token, as if each came from its own step; those after the one that finishes the
    // request are dropped.
    for (size_t j = 0; j < n && out.finish == FinishReason::kNone; ++j) {
      const int num_later = static_cast<int>(n - 1 - j);
      // The first sampled token completes the prompt: its output is the request's first.
      const bool first_output = num_outputs - num_later == 1;
      if (r.prompt_logprobs_due) deliver_prompt_logprobs(r, out);
      // NOTE: every token came from the matcher's own mask, so the grammar takes it.
      RELAY_CHECK(!r.matcher || advance_grammar(r, sampled[i + j].token, first_output), "request ",
                  r.id, ": the grammar refused token ", sampled[i + j].token,
                  ", which its mask allowed");
      on_token(r, sampled[i + j], out, num_later);
    }
    outputs.push_back(std::move(out));
    i += n;
  }
  // A prompt-only request (max_tokens 0) ends with its prompt, having sampled nothing.
  for (const ScheduledChunk& c : plan.chunks) {
    const Sequence& seq = *c.seq;
    if (!seq.prompt_only || seq.num_computed < seq.num_prompt_tokens) continue;
    Request& r = *requests_.at(seq.id);
    RequestOutput out;
    out.id = r.id;
    out.num_prompt_tokens = seq.num_prompt_tokens;
    out.num_cached_tokens = std::max(0, seq.num_cached_prompt_tokens);
    deliver_prompt_logprobs(r, out);
    finish(r, FinishReason::kLength, out);
    outputs.push_back(std::move(out));
  }
  for (RequestOutput& out : outputs) {
    if (out.finish == FinishReason::kNone) continue;
    if (requests_.at(out.id)->hold_kv) {
      const auto table = blocks_.block_table(out.id);
      out.kv_blocks.assign(table.begin(), table.end());
      out.state_slot = state_slot(out.id);
      scheduler_.finish_keeping_blocks(out.id);
      held_kv_.insert(out.id);
    } else {
      scheduler_.finish(out.id);
    }
    requests_.erase(out.id);
  }
  // The draft head's proposals become the drafts of the requests' next steps.
  // NOTE: by id: the sequences of finished requests are gone.
  for (const StepSequence& s : batch) {
    if (s.proposed_drafts == nullptr) continue;
    const auto it = requests_.find(s.seq_id);
    if (it == requests_.end() || it->second->proposed_drafts.empty()) continue;
    set_drafts(s.seq_id, it->second->proposed_drafts);
  }
  last_step_.outputs_s = std::chrono::duration<double>(Clock::now() - forward_end).count();
  return outputs;
}

int LLMEngine::next_drafts(Request& r) {
  return r.draft_length ? r.draft_length->next() : speculative_.num_speculative_tokens;
}

void LLMEngine::count_drafts(int num_drafts, int num_accepted) {
  ++spec_stats_.num_drafts;
  spec_stats_.num_draft_tokens += static_cast<uint64_t>(num_drafts);
  spec_stats_.num_accepted_tokens += static_cast<uint64_t>(num_accepted);
  auto& per_pos = spec_stats_.num_accepted_tokens_per_pos;
  if (per_pos.size() < static_cast<size_t>(num_drafts)) per_pos.resize(static_cast<size_t>(num_drafts), 0);
  for (int pos = 0; pos < num_accepted; ++pos) ++per_pos[static_cast<size_t>(pos)];
}

void LLMEngine::set_drafts(int64_t id, std::span<const int32_t> drafts) {
  RELAY_CHECK(backend_->supports_draft_tokens(), "request ", id, " was given ", drafts.size(),
              " draft tokens, which this backend does not verify");
  const auto it = requests_.find(id);
  Sequence* seq = scheduler_.find(id);
  RELAY_CHECK(it != requests_.end() && seq != nullptr, "set_drafts: no request ", id);
  Request& r = *it->second;
  const int64_t vocab = backend_->config().vocab_size;
  for (int32_t t : drafts) {
    RELAY_CHECK(t >= 0 && t < vocab, "request ", id, ": draft token ", t,
                " is outside the vocabulary [0, ", vocab, ")");
  }
  // A step commits its accepted drafts and one token more, all within max_tokens.
  const int64_t room = r.stop.max_tokens - seq->num_output_tokens() - 1;
  drafts = drafts.first(static_cast<size_t>(std::clamp<int64_t>(room, 0, drafts.size())));
  if (states_ != nullptr) {  // one scratch state slot per draft
    drafts = drafts.first(
        std::min(drafts.size(), static_cast<size_t>(states_->slots_per_sequence() - 1)));
  }
  drafts = drafts.first(walk_grammar(r, drafts, seq->num_output_tokens() == 0, nullptr));
  seq->draft_tokens.assign(drafts.begin(), drafts.end());
}

void LLMEngine::on_token(Request& r, const SampledToken& sampled, RequestOutput& out,
                         int num_later) {
  const Sequence& seq = *scheduler_.find(r.id);
  out.new_tokens.push_back(sampled.token);
  if (r.want_logprobs) out.logprobs.push_back({sampled.token, sampled.logprob, sampled.top});
  out.num_prompt_tokens = seq.num_prompt_tokens;
  out.num_output_tokens = seq.num_output_tokens() - num_later;
  out.num_cached_tokens = std::max(0, seq.num_cached_prompt_tokens);

  const StopConditions& stop = r.stop;
  if (out.num_output_tokens > stop.min_tokens) {
    const auto& eos = backend_->config().eos_token_ids;
    const bool is_eos =
        !stop.ignore_eos && std::find(eos.begin(), eos.end(), sampled.token) != eos.end();
    const bool is_stop = std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(),
                                   sampled.token) != stop.stop_token_ids.end();
    if (is_eos || is_stop) {
      r.text += r.detokenizer.flush();
      if (!is_eos) out.stop_token = sampled.token;
      finish(r, FinishReason::kStop, out);
      return;
    }
  }

  const size_t old_size = r.text.size();
  r.text += r.detokenizer.push(sampled.token);
  if (r.max_stop_len > 0) {
    // Only a match overlapping the new text can be new; find the earliest one.
    const size_t from = old_size >= r.max_stop_len ? old_size - r.max_stop_len + 1 : 0;
    size_t best = std::string::npos, best_len = 0;
    const std::string* matched = nullptr;
    for (const std::string& s : stop.stop_strings) {
      const size_t pos = r.text.find(s, from);
      if (pos < best) {
        best = pos;
        best_len = s.size();
        matched = &s;
      }
    }
    if (best != std::string::npos) {
      out.stop_string = *matched;
      r.text.resize(best + (stop.include_stop_str_in_output ? best_len : 0));
      r.num_sent = std::min(r.num_sent, r.text.size());
      finish(r, FinishReason::kStop, out);
      return;
    }
  }
  if (out.num_output_tokens >= stop.max_tokens ||
      static_cast<int64_t>(seq.tokens.size()) - num_later >= max_model_len_) {
    r.text += r.detokenizer.flush();
    finish(r, FinishReason::kLength, out);
    return;
  }
  // Hold back the longest tail that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& s : stop.stop_strings) {
    for (size_t k = std::min(s.size() - 1, r.text.size() - r.num_sent); k > hold; --k) {
      if (std::string_view(r.text).substr(r.text.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  out.text += r.text.substr(r.num_sent, r.text.size() - hold - r.num_sent);
  r.num_sent = r.text.size() - hold;
}

size_t LLMEngine::walk_grammar(Request& r, std::span<const int32_t> drafts, bool first_output,
                               std::vector<uint32_t>* masks) {
  using Phase = Request::GrammarPhase;
  if (masks != nullptr) masks->clear();
  // Nothing constrains these requests again.
  if (r.grammar_phase == Phase::kNone || r.grammar_phase == Phase::kDone) return drafts.size();
  const Phase phase = r.grammar_phase;
  const int num_accepted = r.matcher->num_accepted_tokens();
  const size_t words = token_bitmask_words(r.matcher->vocab_size());
  bool constrained = false;
  size_t allowed = 0;
  for (;; ++allowed) {
    // Only the request's first token may open a reasoning block.
    const bool first = first_output && allowed == 0;
    if (masks != nullptr) {
      masks->resize((allowed + 1) * words);
      const std::span<uint32_t> row(masks->data() + allowed * words, words);
      if (r.grammar_phase == Phase::kActive) {
        r.matcher->fill_next_token_bitmask(row);
        // A reasoning model may open its block first; the grammar then waits for the block's end.
        if (first && r.reasoning.open >= 0) {
          row[static_cast<size_t>(r.reasoning.open) / 32] |= 1u << (r.reasoning.open % 32);
        }
        constrained = true;
      } else {
        std::fill(row.begin(), row.end(), ~0u);
      }
    }
    if (allowed == drafts.size() || !advance_grammar(r, drafts[allowed], first)) break;
  }
  r.matcher->rollback(r.matcher->num_accepted_tokens() - num_accepted);
  r.grammar_phase = phase;
  if (masks != nullptr && !constrained) masks->clear();
  return allowed;
}

bool LLMEngine::advance_grammar(Request& r, int32_t token, bool first_output) {
  using Phase = Request::GrammarPhase;
  switch (r.grammar_phase) {
    case Phase::kWaiting:
      if (token == r.reasoning.close) r.grammar_phase = Phase::kActive;
      return true;
    case Phase::kActive:
      if (first_output && token == r.reasoning.open) {
        r.grammar_phase = Phase::kWaiting;
        return true;
      }
      if (!r.matcher->accept_token(token)) return false;
      if (r.matcher->is_terminated()) r.grammar_phase = Phase::kDone;
      return true;
    case Phase::kNone:
    case Phase::kDone:
      break;
  }
  return true;
}

void LLMEngine::keep_prompt_logprobs(Request& r, const StepSequence& chunk) {
  std::vector<TokenLogprob>& rows = *chunk.prompt_logprobs;
  RELAY_CHECK(rows.size() == chunk.num_prompt_logprob_rows(), "request ", r.id,
              ": the backend returned ", rows.size(),
              " prompt logprob rows for a chunk that scores ", chunk.num_prompt_logprob_rows());
  // A recompute after preemption scores the same positions again: it overwrites them.
  for (size_t j = 0; j < rows.size(); ++j) {
    r.prompt_logprobs[static_cast<size_t>(chunk.num_computed) + 1 + j] = std::move(rows[j]);
  }
}

void LLMEngine::deliver_prompt_logprobs(Request& r, RequestOutput& out) {
  for (size_t pos = 1; pos < r.prompt_logprobs.size(); ++pos) {
    RELAY_CHECK(r.prompt_logprobs[pos].has_value(), "request ", r.id,
                ": no prompt logprob was computed for prompt position ", pos);
  }
  out.prompt_logprobs = std::move(r.prompt_logprobs);
  r.prompt_logprobs.clear();
  r.prompt_logprobs_due = false;
}

void LLMEngine::finish(Request& r, FinishReason reason, RequestOutput& out) {
  out.text += r.text.substr(r.num_sent);
  r.num_sent = r.text.size();
  out.finish = reason;
  if (r.first_scheduled) {
    out.queue_time_s = std::chrono::duration<double>(*r.first_scheduled - r.arrival).count();
  }
}

}  // namespace relay
