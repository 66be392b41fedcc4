// The messages between the nodes of a multi-node worker (engine/node_group.h): a step and its
// results survive the wire exactly, a sequence's history travels only when its penalties read it,
// and a damaged or foreign message fails with a message instead of being misread.
#include <gtest/gtest.h>

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
  batch[0].prompt_tokens = prompt;
  batch[1] = sequence(-3, tokens_b, 0, blocks_b);
  batch[2] = batch[0];
  batch[2].sampling = &penalised;

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

TEST(NodeMessages, AResultRoundTrips) {
  NodeResult r;
  r.seqs = {0, 2, 5};
  r.sampled.push_back({7, 42, -0.25f, {{42, -0.25f}, {3, -2.5f}}});
  r.sampled.push_back({9, 1, -1.0f, {}});
  r.logits = {1.0f, -2.0f, 3.5f};
  const NodeResult got = decode_result(encode_result(r));
  EXPECT_EQ(got.error, "");
  EXPECT_EQ(got.seqs, r.seqs);
  ASSERT_EQ(got.sampled.size(), 2u);
  EXPECT_EQ(got.sampled[0].seq_id, 7);
  EXPECT_EQ(got.sampled[0].token, 42);
  EXPECT_EQ(got.sampled[0].logprob, -0.25f);
  EXPECT_EQ(got.sampled[0].top, r.sampled[0].top);
  EXPECT_TRUE(got.sampled[1].top.empty());
  EXPECT_EQ(got.logits, r.logits);

  NodeResult failed;
  failed.error = "rank 3: token 123456 is outside the vocabulary";
  EXPECT_EQ(decode_result(encode_result(failed)).error, failed.error);
}

TEST(NodeMessages, DamagedOrForeignMessagesFail) {
  const std::vector<int32_t> tokens{1, 2}, blocks{0};
  const std::vector<StepSequence> batch{sequence(1, tokens, 0, blocks)};
  std::vector<uint8_t> bytes = encode_step(NodeCommand::kLogitsAll, batch);
  auto error_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
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
}

}  // namespace
}  // namespace relay
