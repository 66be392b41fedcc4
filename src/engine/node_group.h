// The control plane of a multi-node worker: how the leader (node 0) hands every step to the other
// nodes and collects what they computed.
//
// A worker's ranks may live in several processes (parallel::NodeConfig). Only the leader runs the
// scheduler; each step it broadcasts the batch to the followers, every node runs its own ranks on
// it (their collectives cross processes through parallel/tcp_group.h), and each node answers with
// the results of the sequences whose logits it holds: the sampled tokens, or the logit rows a
// scoring call asked for. The messages travel over the nodes' TcpBootstrap, a star around the
// leader, which is what they need: one broadcast and one gather per step.
//
// A step message carries everything a follower needs to run and sample its sequences (tokens,
// block tables, sampling parameters, draft counts and prompt-logprob counts; the prompt tokens only
// for a sequence whose penalties read them or that asks for prompt logprobs, whose targets they
// are; the output tokens only for penalties; under an MTP head, a chunk that does not sample sends
// both up to the token after it, which the head's catch-up reads). Sampling is a pure function of
// (seed, sample index), so a sequence samples the same token on whichever node holds its logits,
// and verifies its drafts there (its result then holds its accepted drafts and the token after
// them); its prompt logprobs come back from that node too (a follower's decoded step has no
// prompt_logprobs output: they travel in its NodeResult). With an MTP head, each node drafts for
// the sequences it samples, and its drafts come back in its NodeResult too.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "parallel/parallel_config.h"
#include "parallel/tcp_bootstrap.h"

namespace relay {

enum class NodeCommand : uint8_t {
  kStep = 1,        // run and sample (Backend::step)
  kLogitsLast = 2,  // run; return every sequence's last-token logits
  kLogitsAll = 3,   // run; return the logits of every token
  kReset = 4,       // a step failed somewhere: re-arm the collectives
  kShutdown = 5,    // the leader is closing: followers return
};

// A step as a follower receives it: the batch with its own storage.
struct NodeStep {
  NodeCommand command = NodeCommand::kShutdown;
  std::vector<StepSequence> batch;  // spans into the vectors below
  std::vector<std::vector<int32_t>> tokens, block_tables, prompt_tokens, output_tokens;
  std::vector<SamplingParams> sampling;  // one per sequence (read only when it samples)
  std::vector<std::vector<uint32_t>> allowed_tokens;  // token constraints of sampling sequences
  std::vector<std::vector<std::pair<int32_t, float>>> logit_bias;
  std::vector<std::vector<int32_t>> state_slots;        // hybrid models' recurrent-state slots
  std::vector<std::vector<SnapshotSave>> snapshot_saves;  // and the prefix-cache saves
  // Where a sequence that wants drafts (StepSequence::proposed_drafts) has them written.
  std::vector<std::vector<int32_t>> proposed_drafts;
};

// What one node answers for a step.
struct NodeResult {
  std::string error;                  // empty: the step ran on every rank of the node
  std::vector<uint32_t> seqs;         // batch indices of the sequences this node holds, ascending
  // kStep: per sequence of `seqs` that samples, its accepted drafts and the token sampled after
  // them (one token without drafts), consecutive.
  std::vector<SampledToken> sampled;
  // kStep: one per sequence of `seqs` with prompt logprob rows (num_prompt_logprob_rows() > 0), in
  // order, each holding its rows.
  std::vector<std::vector<TokenLogprob>> prompt_logprobs;
  // kStep with an MTP head: one per sequence of `seqs` that samples and wants drafts
  // (StepSequence::proposed_drafts), in order, each its drafts for the next step.
  std::vector<std::vector<int32_t>> drafts;
  std::vector<float> logits;          // kLogits*: the rows of `seqs`, concatenated
};

class NodeGroup {
 public:
  // Joins the nodes at nodes.dist_init (the leader listens, the followers connect); blocks until
  // all nnodes have joined or `setup_timeout` passed. `step_timeout` bounds the leader's wait for
  // the followers' answers.
  NodeGroup(const parallel::NodeConfig& nodes, std::chrono::milliseconds setup_timeout,
            std::chrono::milliseconds step_timeout);

  const parallel::NodeConfig& config() const { return config_; }
  parallel::TcpBootstrap& bootstrap() { return bootstrap_; }

  // Leader: sends the command (and, for a step, the batch) to every follower; `mtp`: the worker
  // runs an MTP head (see encode_step).
  void send(NodeCommand command, std::span<const StepSequence> batch = {}, bool mtp = false);
  // Leader: every node's answer, by node (mine at index 0). Throws relay::Error when a follower
  // does not answer in time or its connection is gone.
  std::vector<NodeResult> gather(NodeResult mine);

  // Follower: waits, without a time limit, for the leader's next command. Throws relay::Error when
  // the leader's connection closes.
  NodeStep receive();
  // Follower: answers the step just received.
  void reply(const NodeResult& result);

 private:
  parallel::NodeConfig config_;
  std::chrono::milliseconds step_timeout_;
  parallel::TcpBootstrap bootstrap_;
};

// The wire format, exposed for its round-trip test.
// `mtp`: the worker runs an MTP head, so a chunk that does not sample carries its prompt and
// output tokens up to the one after it (plan_mtp_catch_up pairs its last row with that token).
std::vector<uint8_t> encode_step(NodeCommand command, std::span<const StepSequence> batch,
                                 bool mtp = false);
NodeStep decode_step(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_result(const NodeResult& result);
NodeResult decode_result(std::span<const uint8_t> bytes);

}  // namespace relay
