// The engine loop's delivery thread: what reaches the handles equals what LLMEngine::step()
// returns when driven directly, request by request and in order, at batch sizes where delivery runs
// while the engine computes the next step; aborts, failures and stop() reach a handle after its
// earlier outputs; the step phases and deliveries show up in the metrics.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../scheduler/fake_backend.h"
#include "engine/llm_engine.h"
#include "server/engine_loop.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace relay::server {
namespace {

using namespace std::chrono_literals;

const Tokenizer& demo_tokenizer() {
  static const Tokenizer t = Tokenizer::from_model_dir(RELAY_SOURCE_DIR "/models/relay-demo-moe");
  return t;
}

// What a client ends up with: the concatenated stream and the final output's fields.
struct Stream {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<TokenLogprob> logprobs;
  FinishReason finish = FinishReason::kNone;
  int num_prompt_tokens = 0;
  int num_output_tokens = 0;
  int num_outputs = 0;
  bool operator==(const Stream& o) const {
    auto same_logprobs = [&] {
      if (logprobs.size() != o.logprobs.size()) return false;
      for (size_t i = 0; i < logprobs.size(); ++i) {
        if (logprobs[i].token != o.logprobs[i].token ||
            logprobs[i].logprob != o.logprobs[i].logprob || logprobs[i].top != o.logprobs[i].top)
          return false;
      }
      return true;
    };
    return tokens == o.tokens && text == o.text && finish == o.finish &&
           num_prompt_tokens == o.num_prompt_tokens && num_output_tokens == o.num_output_tokens &&
           same_logprobs();
  }
};

// Appends one output, checking that it continues the stream.
void append(Stream& s, const RequestOutput& out) {
  EXPECT_EQ(s.finish, FinishReason::kNone) << "request " << out.id << ": an output after the last";
  s.tokens.insert(s.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
  EXPECT_EQ(out.num_output_tokens, static_cast<int>(s.tokens.size()))
      << "request " << out.id << ": outputs out of order";
  s.text += out.text;
  s.logprobs.insert(s.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  s.finish = out.finish;
  s.num_prompt_tokens = out.num_prompt_tokens;
  s.num_output_tokens = out.num_output_tokens;
  ++s.num_outputs;
}

// A mix of what the engine's output processing handles: stop strings (held back and cut),
// include_stop_str_in_output, min_tokens, EOS, logprobs, sampling with a seed, lengths.
EngineRequest make_request(int i) {
  EngineRequest r;
  for (int t = 0; t < 5 + i % 23; ++t) r.prompt.push_back((i * 37 + t * 11) % 900);
  r.stop.max_tokens = 8 + (i * 7) % 40;
  if (i % 3 == 0) r.stop.stop_strings = {"e", "th"};
  if (i % 5 == 0) r.stop.include_stop_str_in_output = true;
  if (i % 4 == 0) r.stop.min_tokens = 3;
  if (i % 6 == 1) r.sampling.num_logprobs = 2;
  r.sampling.temperature = i % 2 ? 0.0f : 0.8f;
  r.sampling.seed = 1000 + static_cast<uint64_t>(i);
  return r;
}

// The reference: one engine driven directly, all requests added up front.
std::map<int64_t, Stream> run_direct(int num_requests, int num_blocks) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(num_blocks, 4), demo_tokenizer(),
                   {.max_num_seqs = 256});
  for (int i = 0; i < num_requests; ++i) engine.add_request(i + 1, make_request(i));
  std::map<int64_t, Stream> streams;
  while (engine.has_work()) {
    for (const RequestOutput& out : engine.step()) append(streams[out.id], out);
  }
  return streams;
}

TEST(EngineLoop, DeliveredStreamsEqualTheEngineRunDirectly) {
  constexpr int kRequests = 200;
  // A small pool, so sequences are also preempted and recomputed.
  for (const int num_blocks : {4096, 160}) {
    SCOPED_TRACE(num_blocks);
    const std::map<int64_t, Stream> expected = run_direct(kRequests, num_blocks);
    LLMEngine engine(std::make_unique<testing::FakeBackend>(num_blocks, 4), demo_tokenizer(),
                     {.max_num_seqs = 256});
    Metrics metrics("test");
    EngineLoop loop(engine, metrics);
    std::vector<std::shared_ptr<RequestHandle>> handles;
    for (int i = 0; i < kRequests; ++i) handles.push_back(loop.submit(make_request(i)));
    ASSERT_EQ(handles.front()->id(), 1);
    std::vector<Stream> got(kRequests);
    std::vector<std::thread> readers;
    for (int i = 0; i < kRequests; ++i) {
      readers.emplace_back([&, i] {
        const auto deadline = std::chrono::steady_clock::now() + 60s;
        while (!handles[i]->done() && std::chrono::steady_clock::now() < deadline) {
          for (const RequestOutput& out : handles[i]->next(100ms)) append(got[i], out);
        }
      });
    }
    for (std::thread& t : readers) t.join();
    EXPECT_EQ(loop.num_unfinished(), 0);
    int num_outputs = 0;
    std::map<FinishReason, int> finishes;
    for (int i = 0; i < kRequests; ++i) {
      ++finishes[got[i].finish];
      EXPECT_TRUE(handles[i]->done()) << "request " << i;
      EXPECT_TRUE(handles[i]->error().empty()) << handles[i]->error();
      EXPECT_TRUE(got[i] == expected.at(i + 1))
          << "request " << i << ": " << got[i].text << " vs " << expected.at(i + 1).text;
      EXPECT_NE(got[i].finish, FinishReason::kNone);
      num_outputs += got[i].num_outputs;
    }
    // The mix covers both ways to finish, and the small pool preempts.
    EXPECT_GT(finishes[FinishReason::kStop], 10);
    EXPECT_GT(finishes[FinishReason::kLength], 10);
    if (num_blocks < 1000) {
      EXPECT_GT(engine.stats().scheduler.num_preemptions, 0u);
    }
    loop.stop();
    const std::string text = metrics.render();
    EXPECT_NE(text.find("relay:output_deliveries_total{model_name=\"test\"} " +
                        std::to_string(num_outputs) + "\n"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("relay:engine_step_phase_seconds_total{model_name=\"test\",kind=\"decode\","
                        "phase=\"forward\"}"),
              std::string::npos);
  }
}

TEST(EngineLoop, AbortEndsTheStreamAfterItsOutputs) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(4096, 4), demo_tokenizer(), {});
  Metrics metrics("test");
  EngineLoop loop(engine, metrics);
  EngineRequest r = make_request(1);
  r.stop.max_tokens = 5000;
  r.stop.ignore_eos = true;
  r.stop.stop_strings.clear();
  auto h = loop.submit(std::move(r));
  Stream s;
  while (s.num_output_tokens < 5 && !h->done()) {
    for (const RequestOutput& out : h->next(100ms)) append(s, out);
  }
  loop.abort(h->id());
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!h->done() && std::chrono::steady_clock::now() < deadline) {
    for (const RequestOutput& out : h->next(100ms)) append(s, out);
  }
  EXPECT_TRUE(h->done());
  EXPECT_EQ(s.finish, FinishReason::kAbort);
  EXPECT_TRUE(h->error().empty());
  EXPECT_EQ(loop.num_unfinished(), 0);
}

TEST(EngineLoop, StopFailsWhatIsInFlightAfterItsOutputs) {
  LLMEngine engine(std::make_unique<testing::FakeBackend>(4096, 4), demo_tokenizer(),
                   {.max_num_seqs = 64});
  Metrics metrics("test");
  EngineLoop loop(engine, metrics);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  for (int i = 0; i < 100; ++i) {  // 64 run, 36 wait
    EngineRequest r = make_request(i);
    r.stop.max_tokens = 5000;
    r.stop.ignore_eos = true;
    r.stop.stop_strings.clear();
    handles.push_back(loop.submit(std::move(r)));
  }
  std::vector<Stream> streams(handles.size());
  while (streams[0].num_outputs < 3 && !handles[0]->done()) {
    for (const RequestOutput& out : handles[0]->next(100ms)) append(streams[0], out);
  }
  loop.stop();
  EXPECT_EQ(loop.num_unfinished(), 0);
  for (size_t i = 0; i < handles.size(); ++i) {
    // Whatever was pushed before the failure is still there, in order, and none of it is final.
    for (const RequestOutput& out : handles[i]->next(0ms)) append(streams[i], out);
    EXPECT_EQ(streams[i].finish, FinishReason::kNone);
    EXPECT_TRUE(handles[i]->done());
    EXPECT_EQ(handles[i]->error(), "the server is shutting down");
  }
  EXPECT_TRUE(loop.submit(make_request(0))->done());  // refused once stopped
}

}  // namespace
}  // namespace relay::server
