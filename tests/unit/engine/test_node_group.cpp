// The messages between the nodes of a multi-node worker (engine/node_group.h): a step and its
// results survive the wire exactly (drafts and the several tokens a sequence with drafts commits
// included), a sequence's history travels only when its penalties read it (its prompt also when it
// asks for prompt logprobs), and a damaged or foreign message fails with a message instead of being
// misread (draft counts and per-row bitmasks out of bounds included); under an MTP head a chunk
// that does not sample carries the token after it, and a result the drafts of its sequences.
#include <gtest/gtest.h>

#include "../error_text.h"
#include "core/error.h"
#include "engine/node_group.h"

namespace relay {
namespace {

StepSequence sequence(int64_t id, std::span<const int32_t> tokens, int32_t num_computed,
                      std::span<const int32_t> blocks) {
  StepSequence s;
  s.seq_id = id;
  s.tokens = tokens;
  s.num_computed = num_computed;
  s.block_table = blocks;
  return s;
}

TEST(NodeMessages, AStepRoundTrips) {
  const std::vector<int32_t> tokens_a{1, 2, 3}, blocks_a{4, 5}, tokens_b{9}, blocks_b{7};
  const std::vector<int32_t> prompt{1, 2, 3, 8}, output{10, 11};
  SamplingParams plain;
  plain.temperature = 0.7f;
  plain.top_k = 20;
  plain.seed = 99;
  plain.num_logprobs = 2;
  SamplingParams penalised = plain;
  penalised.presence_penalty = 0.5f;
  std::vector<StepSequence> batch(3);
  batch[0] = sequence(11, tokens_a, 4, blocks_a);
  batch[0].sample = true;
  batch[0].sampling = &plain;
  batch[0].output_tokens = output;
  batch[0].sample_index = 2;
  batch[0].num_draft_tokens = 2;
  batch[0].prompt_tokens = prompt;
  batch[1] = sequence(-3, tokens_b, 0, blocks_b);
  batch[2] = batch[0];
  batch[2].num_draft_tokens = 0;
  batch[2].sampling = &penalised;
  // Token constraints travel with a sampling sequence.
  const std::vector<uint32_t> mask{0xf0u, 0x1u};
  const std::vector<std::pair<int32_t, float>> bias{{3, 2.5f}, {40, -100.0f}};
  batch[2].allowed_tokens = mask;
  batch[2].logit_bias = bias;
  // A hybrid model's recurrent state: its slots, a snapshot to restore, snapshots to save.
  const std::vector<int32_t> slots{6, 7, 8};
  const std::vector<SnapshotSave> saves{{0, 3}, {2, 5}};
  batch[1].state_slots = slots;
  batch[1].restore_state_snapshot = 4;
  batch[1].save_state_snapshots = saves;

  const NodeStep got = decode_step(encode_step(NodeCommand::kStep, batch));
  EXPECT_EQ(got.command, NodeCommand::kStep);
  ASSERT_EQ(got.batch.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const StepSequence &want = batch[i], &s = got.batch[i];
    EXPECT_EQ(s.seq_id, want.seq_id);
    EXPECT_EQ(s.num_computed, want.num_computed);
    EXPECT_EQ(std::vector(s.tokens.begin(), s.tokens.end()),
              std::vector(want.tokens.begin(), want.tokens.end()));
    EXPECT_EQ(std::vector(s.block_table.begin(), s.block_table.end()),
              std::vector(want.block_table.begin(), want.block_table.end()));
    EXPECT_EQ(s.sample, want.sample);
    EXPECT_EQ(s.num_draft_tokens, want.num_draft_tokens);
    EXPECT_EQ(std::vector(s.state_slots.begin(), s.state_slots.end()),
              std::vector(want.state_slots.begin(), want.state_slots.end()));
    EXPECT_EQ(s.restore_state_snapshot, want.restore_state_snapshot);
    ASSERT_EQ(s.save_state_snapshots.size(), want.save_state_snapshots.size());
    for (size_t k = 0; k < s.save_state_snapshots.size(); ++k) {
      EXPECT_EQ(s.save_state_snapshots[k].row, want.save_state_snapshots[k].row);
      EXPECT_EQ(s.save_state_snapshots[k].snapshot, want.save_state_snapshots[k].snapshot);
    }
    if (!want.sample) {
      EXPECT_EQ(s.sampling, nullptr);
      continue;
    }
    ASSERT_NE(s.sampling, nullptr);
    EXPECT_EQ(s.sampling->temperature, want.sampling->temperature);
    EXPECT_EQ(s.sampling->top_k, want.sampling->top_k);
    EXPECT_EQ(s.sampling->seed, want.sampling->seed);
    EXPECT_EQ(s.sampling->num_logprobs, want.sampling->num_logprobs);
    EXPECT_EQ(s.sampling->presence_penalty, want.sampling->presence_penalty);
    EXPECT_EQ(s.sample_index, want.sample_index);
    EXPECT_EQ(std::vector(s.allowed_tokens.begin(), s.allowed_tokens.end()),
              std::vector(want.allowed_tokens.begin(), want.allowed_tokens.end()));
    EXPECT_EQ(std::vector(s.logit_bias.begin(), s.logit_bias.end()),
              std::vector(want.logit_bias.begin(), want.logit_bias.end()));
  }
  // The history only goes with the sequence whose penalties read it.
  EXPECT_TRUE(got.batch[0].prompt_tokens.empty());
  EXPECT_TRUE(got.batch[0].output_tokens.empty());
  EXPECT_EQ(std::vector(got.batch[2].prompt_tokens.begin(), got.batch[2].prompt_tokens.end()),
            prompt);
  EXPECT_EQ(std::vector(got.batch[2].output_tokens.begin(), got.batch[2].output_tokens.end()),
            output);

  EXPECT_EQ(decode_step(encode_step(NodeCommand::kShutdown, {})).command, NodeCommand::kShutdown);
}

// A sequence asking for prompt logprobs sends its prompt (the targets) whether or not it samples;
// the output pointer stays on the leader.
TEST(NodeMessages, PromptLogprobsSendThePrompt) {
  const std::vector<int32_t> prompt{1, 2, 3, 8, 9}, chunk{1, 2, 3}, tail{8, 9}, blocks{0};
  SamplingParams plain;
  std::vector<TokenLogprob> rows;
  std::vector<StepSequence> batch(3);
  batch[0] = sequence(1, chunk, 0, blocks);
  batch[0].prompt_tokens = prompt;
  batch[0].num_prompt_logprobs = 4;
  batch[0].prompt_logprobs = &rows;
  batch[1] = sequence(2, tail, 3, blocks);
  batch[1].prompt_tokens = prompt;
  batch[1].num_prompt_logprobs = 0;
  batch[1].prompt_logprobs = &rows;
  batch[1].sample = true;
  batch[1].sampling = &plain;
  batch[2] = sequence(3, chunk, 0, blocks);
  batch[2].prompt_tokens = prompt;  // no penalties, no prompt logprobs: not sent

  const NodeStep got = decode_step(encode_step(NodeCommand::kStep, batch));
  ASSERT_EQ(got.batch.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(got.batch[i].num_prompt_logprobs, batch[i].num_prompt_logprobs);
    EXPECT_EQ(got.batch[i].prompt_logprobs, nullptr);
    EXPECT_EQ(got.batch[i].num_prompt_logprob_rows(),
              i == 2 ? 0u : batch[i].num_prompt_logprob_rows());
  }
  EXPECT_EQ(got.batch[0].num_prompt_logprob_rows(), 3u);
  EXPECT_EQ(got.batch[1].num_prompt_logprob_rows(), 1u);  // the last row samples
  EXPECT_EQ(std::vector(got.batch[0].prompt_tokens.begin(), got.batch[0].prompt_tokens.end()),
            prompt);
  EXPECT_EQ(std::vector(got.batch[1].prompt_tokens.begin(), got.batch[1].prompt_tokens.end()),
            prompt);
  EXPECT_TRUE(got.batch[2].prompt_tokens.empty());
  EXPECT_TRUE(got.batch[1].output_tokens.empty());
}

// Under an MTP head a chunk that does not sample sends its prompt and output tokens up to the one
// after it (the head's catch-up pairs its last row with that token), indices kept: a prompt chunk,
// a recompute chunk whose next token is an output, and a prompt's last chunk (nothing after it).
TEST(NodeMessages, UnderAnMtpHeadAChunkSendsTheTokenAfterIt) {
  const std::vector<int32_t> prompt{1, 2, 3, 4, 5, 6}, output{7, 8, 9}, blocks{0};
  const std::vector<int32_t> first{1, 2, 3}, recompute{5, 6, 7}, last{4, 5, 6};
  std::vector<StepSequence> batch{sequence(1, first, 0, blocks), sequence(2, recompute, 4, blocks),
                                  sequence(3, last, 3, blocks)};
  for (StepSequence& s : batch) s.prompt_tokens = prompt;
  batch[1].output_tokens = output;
  auto tokens = [](std::span<const int32_t> s) { return std::vector(s.begin(), s.end()); };
  const NodeStep plain = decode_step(encode_step(NodeCommand::kStep, batch));
  for (const StepSequence& s : plain.batch) EXPECT_TRUE(s.prompt_tokens.empty());
  const NodeStep got = decode_step(encode_step(NodeCommand::kStep, batch, /*mtp=*/true));
  EXPECT_EQ(tokens(got.batch[0].prompt_tokens), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_TRUE(got.batch[0].output_tokens.empty());
  EXPECT_EQ(tokens(got.batch[1].prompt_tokens), prompt);
  EXPECT_EQ(tokens(got.batch[1].output_tokens), (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(tokens(got.batch[2].prompt_tokens), prompt);
  EXPECT_TRUE(got.batch[2].output_tokens.empty());
}

// Drafts travel with a sampling sequence, with one bitmask per sampled row; a count that leaves no
// token before the drafts, or a bitmask that does not split into the rows, fails to decode.
TEST(NodeMessages, DraftsTravelWithinTheirBounds) {
  const std::vector<int32_t> tokens{4, 5, 6}, blocks{0};
  const std::vector<uint32_t> masks{1, 2, 3, 4, 5, 6};  // 3 rows of 2 words
  SamplingParams plain;
  std::vector<StepSequence> batch{sequence(1, tokens, 7, blocks)};
  batch[0].sample = true;
  batch[0].sampling = &plain;
  batch[0].num_draft_tokens = 2;
  batch[0].allowed_tokens = masks;
  const NodeStep got = decode_step(encode_step(NodeCommand::kStep, batch));
  EXPECT_EQ(got.batch[0].num_draft_tokens, 2);
  EXPECT_EQ(std::vector(got.batch[0].allowed_tokens.begin(), got.batch[0].allowed_tokens.end()),
            masks);
  // Whether the sequence wants MTP drafts for its next step: the follower writes them into its
  // own storage (node 0's pointer stays on node 0).
  EXPECT_EQ(got.batch[0].proposed_drafts, nullptr);
  std::vector<int32_t> proposed;
  batch[0].proposed_drafts = &proposed;
  batch[0].max_proposed_drafts = 2;  // min_draft_acceptance's cap travels with it
  const NodeStep wants = decode_step(encode_step(NodeCommand::kStep, batch));
  ASSERT_NE(wants.batch[0].proposed_drafts, nullptr);
  EXPECT_EQ(wants.batch[0].proposed_drafts, &wants.proposed_drafts[0]);
  EXPECT_EQ(wants.batch[0].max_proposed_drafts, 2);
  batch[0].max_proposed_drafts = -1;
  EXPECT_NE(test::error_text([&] { decode_step(encode_step(NodeCommand::kStep, batch)); })
                .find("asks for -1 proposed drafts"),
            std::string::npos);
  batch[0].max_proposed_drafts = 2;
  batch[0].proposed_drafts = nullptr;
  auto error_of = [&](int32_t num_drafts, std::span<const uint32_t> mask) {
    batch[0].num_draft_tokens = num_drafts;
    batch[0].allowed_tokens = mask;
    return test::error_text([&] { decode_step(encode_step(NodeCommand::kStep, batch)); });
  };
  EXPECT_NE(error_of(3, {}).find("3 drafts among its 3 tokens"), std::string::npos);
  EXPECT_NE(error_of(-1, {}).find("drafts"), std::string::npos);
  EXPECT_NE(error_of(1, std::span<const uint32_t>(masks).subspan(1))
                .find("bitmask of 5 words for 2 sampled rows"),
            std::string::npos);
}

SampledToken sampled(int64_t seq_id, TokenLogprob t) {
  SampledToken s;
  static_cast<TokenLogprob&>(s) = std::move(t);
  s.seq_id = seq_id;
  return s;
}

TEST(NodeMessages, AResultRoundTrips) {
  NodeResult r;
  r.seqs = {0, 2, 5};
  r.sampled.push_back(sampled(7, {42, -0.25f, {{42, -0.25f}, {3, -2.5f}}, 1}));
  r.sampled.push_back(sampled(9, {1, -1.0f, {}}));
  r.sampled.push_back(sampled(9, {3, -2.0f, {}}));  // 9 had a draft accepted
  r.prompt_logprobs = {{{5, -1.5f, {{2, -0.5f}}, 4}, {6, -0.75f, {{6, -0.75f}}, 1}}, {}};
  r.drafts = {{11, 12}, {}};  // MTP drafts: 9's, and 7's (its blocks ended)
  r.logits = {1.0f, -2.0f, 3.5f};
  const NodeResult got = decode_result(encode_result(r));
  EXPECT_EQ(got.error, "");
  EXPECT_EQ(got.seqs, r.seqs);
  ASSERT_EQ(got.sampled.size(), 3u);
  EXPECT_EQ(got.sampled[0].seq_id, 7);
  EXPECT_EQ(got.sampled[0].token, 42);
  EXPECT_EQ(got.sampled[0].logprob, -0.25f);
  EXPECT_EQ(got.sampled[0].top, r.sampled[0].top);
  EXPECT_EQ(got.sampled[0].rank, 1);
  EXPECT_TRUE(got.sampled[1].top.empty());
  EXPECT_EQ(got.sampled[2].seq_id, 9);
  EXPECT_EQ(got.sampled[2].token, 3);
  ASSERT_EQ(got.prompt_logprobs.size(), 2u);
  ASSERT_EQ(got.prompt_logprobs[0].size(), 2u);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_EQ(got.prompt_logprobs[0][j].token, r.prompt_logprobs[0][j].token);
    EXPECT_EQ(got.prompt_logprobs[0][j].logprob, r.prompt_logprobs[0][j].logprob);
    EXPECT_EQ(got.prompt_logprobs[0][j].top, r.prompt_logprobs[0][j].top);
    EXPECT_EQ(got.prompt_logprobs[0][j].rank, r.prompt_logprobs[0][j].rank);
  }
  EXPECT_TRUE(got.prompt_logprobs[1].empty());
  EXPECT_EQ(got.drafts, r.drafts);
  EXPECT_EQ(got.logits, r.logits);

  NodeResult failed;
  failed.error = "rank 3: token 123456 is outside the vocabulary";
  EXPECT_EQ(decode_result(encode_result(failed)).error, failed.error);
}

TEST(NodeMessages, DamagedOrForeignMessagesFail) {
  const std::vector<int32_t> tokens{1, 2}, blocks{0};
  const std::vector<StepSequence> batch{sequence(1, tokens, 0, blocks)};
  std::vector<uint8_t> bytes = encode_step(NodeCommand::kLogitsAll, batch);
  auto error_of = [](auto&& fn) { return test::error_text(fn); };
  for (size_t cut : {size_t{0}, size_t{1}, bytes.size() / 2, bytes.size() - 1}) {
    const std::vector<uint8_t> part(bytes.begin(), bytes.begin() + static_cast<long>(cut));
    EXPECT_NE(error_of([&] { decode_step(part); }).find("truncated"), std::string::npos)
        << "cut at " << cut;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_NE(error_of([&] { decode_step(longer); }).find("left over"), std::string::npos);
  std::vector<uint8_t> foreign = bytes;
  foreign[0] = 77;
  EXPECT_NE(error_of([&] { decode_step(foreign); }).find("same relay build"), std::string::npos);
  // A corrupt count fails on the bytes left, not in an allocation of billions of entries.
  std::vector<uint8_t> huge = bytes;
  huge[2] = huge[3] = huge[4] = huge[5] = 0xff;
  EXPECT_NE(error_of([&] { decode_step(huge); }).find("truncated"), std::string::npos);
  // num_prompt_logprobs follows the sample flag: version, command, count, id, num_computed, the
  // two arrays (2 tokens, 1 block), then the flag.
  std::vector<uint8_t> negative = bytes;
  const size_t at = 1 + 1 + 4 + 8 + 4 + (4 + 2 * 4) + (4 + 4) + 1;
  negative[at] = negative[at + 1] = negative[at + 2] = negative[at + 3] = 0xfe;
  EXPECT_NE(error_of([&] { decode_step(negative); }).find("num_prompt_logprobs"),
            std::string::npos);
  // A result's prompt logprob counts are checked against the bytes left too.
  NodeResult result;
  result.prompt_logprobs = {{{1, -1.0f, {}}}};
  std::vector<uint8_t> rows = encode_result(result);
  const size_t rows_at = 1 + 4 + 4 + 4 + 4;  // version, error, seqs, sampled, sequences
  rows[rows_at] = rows[rows_at + 1] = rows[rows_at + 2] = rows[rows_at + 3] = 0xff;
  EXPECT_NE(error_of([&] { decode_result(rows); }).find("truncated"), std::string::npos);
}

}  // namespace
}  // namespace relay
