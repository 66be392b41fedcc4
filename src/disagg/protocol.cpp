// See protocol.h.
#include "disagg/protocol.h"

namespace relay::disagg {

using nlohmann::json;

json request_to_json(const EngineRequest& r) {
  const SamplingParams& s = r.sampling;
  const StopConditions& c = r.stop;
  return {{"prompt", r.prompt},
          {"sampling",
           {{"temperature", s.temperature},
            {"top_k", s.top_k},
            {"top_p", s.top_p},
            {"min_p", s.min_p},
            {"presence_penalty", s.presence_penalty},
            {"frequency_penalty", s.frequency_penalty},
            {"repetition_penalty", s.repetition_penalty},
            {"seed", s.seed},
            {"num_logprobs", s.num_logprobs}}},
          {"stop",
           {{"max_tokens", c.max_tokens},
            {"min_tokens", c.min_tokens},
            {"stop_token_ids", c.stop_token_ids},
            {"stop_strings", c.stop_strings},
            {"ignore_eos", c.ignore_eos},
            {"include_stop_str_in_output", c.include_stop_str_in_output},
            {"skip_special_tokens", c.skip_special_tokens}}}};
}

EngineRequest request_from_json(const json& j) {
  EngineRequest r;
  r.prompt = field<std::vector<int32_t>>(j, "prompt", "request");
  const json s = field<json>(j, "sampling", "request");
  r.sampling.temperature = field<float>(s, "temperature", "sampling");
  r.sampling.top_k = field<int>(s, "top_k", "sampling");
  r.sampling.top_p = field<float>(s, "top_p", "sampling");
  r.sampling.min_p = field<float>(s, "min_p", "sampling");
  r.sampling.presence_penalty = field<float>(s, "presence_penalty", "sampling");
  r.sampling.frequency_penalty = field<float>(s, "frequency_penalty", "sampling");
  r.sampling.repetition_penalty = field<float>(s, "repetition_penalty", "sampling");
  r.sampling.seed = field<uint64_t>(s, "seed", "sampling");
  r.sampling.num_logprobs = field<int>(s, "num_logprobs", "sampling");
  const json c = field<json>(j, "stop", "request");
  r.stop.max_tokens = field<int64_t>(c, "max_tokens", "stop");
  r.stop.min_tokens = field<int64_t>(c, "min_tokens", "stop");
  r.stop.stop_token_ids = field<std::vector<int32_t>>(c, "stop_token_ids", "stop");
  r.stop.stop_strings = field<std::vector<std::string>>(c, "stop_strings", "stop");
  r.stop.ignore_eos = field<bool>(c, "ignore_eos", "stop");
  r.stop.include_stop_str_in_output = field<bool>(c, "include_stop_str_in_output", "stop");
  r.stop.skip_special_tokens = field<bool>(c, "skip_special_tokens", "stop");
  return r;
}

namespace {

FinishReason finish_from_name(const std::string& name) {
  for (FinishReason r :
       {FinishReason::kNone, FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort}) {
    if (name == finish_reason_name(r)) return r;
  }
  fail(str("output: unknown finish reason \"", name, "\""));
}

json top_to_json(const std::vector<std::pair<int32_t, float>>& top) {
  json out = json::array();
  for (const auto& [id, lp] : top) out.push_back({id, lp});
  return out;
}

std::vector<std::pair<int32_t, float>> top_from_json(const json& j) {
  std::vector<std::pair<int32_t, float>> out;
  for (const json& e : j) {
    if (!e.is_array() || e.size() != 2) fail("top logprobs: each entry must be [token, logprob]");
    out.emplace_back(e[0].get<int32_t>(), e[1].get<float>());
  }
  return out;
}

}  // namespace

json output_to_json(const RequestOutput& o) {
  json logprobs = json::array();
  for (const TokenLogprob& lp : o.logprobs) {
    logprobs.push_back(
        {{"token", lp.token}, {"logprob", lp.logprob}, {"top", top_to_json(lp.top)}});
  }
  json out = {{"id", o.id},
              {"new_tokens", o.new_tokens},
              {"text", o.text},
              {"logprobs", logprobs},
              {"finish", finish_reason_name(o.finish)},
          {"num_prompt_tokens", o.num_prompt_tokens},
          {"num_output_tokens", o.num_output_tokens},
              {"num_cached_tokens", o.num_cached_tokens},
              {"queue_time_s", o.queue_time_s}};
  if (o.stop_token) out["stop_token"] = *o.stop_token;
  if (o.stop_string) out["stop_string"] = *o.stop_string;
  return out;
}

RequestOutput output_from_json(const json& j) {
  RequestOutput o;
  o.id = field<int64_t>(j, "id", "output");
  o.new_tokens = field<std::vector<int32_t>>(j, "new_tokens", "output");
  o.text = field<std::string>(j, "text", "output");
  for (const json& lp : field<json>(j, "logprobs", "output")) {
    o.logprobs.push_back({field<int32_t>(lp, "token", "logprob"),
                          field<float>(lp, "logprob", "logprob"),
                          top_from_json(field<json>(lp, "top", "logprob"))});
  }
  o.finish = finish_from_name(field<std::string>(j, "finish", "output"));
  o.num_prompt_tokens = field<int>(j, "num_prompt_tokens", "output");
  o.num_output_tokens = field<int>(j, "num_output_tokens", "output");
  o.num_cached_tokens = field<int>(j, "num_cached_tokens", "output");
  o.queue_time_s = field<double>(j, "queue_time_s", "output");
  if (j.contains("stop_token")) o.stop_token = field<int32_t>(j, "stop_token", "output");
  if (j.contains("stop_string")) o.stop_string = field<std::string>(j, "stop_string", "output");
  return o;
}

json first_token_to_json(const FirstToken& t) {
  return {{"token", t.token.token},
          {"logprob", t.token.logprob},
          {"top", top_to_json(t.token.top)},
          {"num_cached_tokens", t.num_cached_tokens}};
}

FirstToken first_token_from_json(const json& j) {
  FirstToken t;
  t.token.token = field<int32_t>(j, "token", "first token");
  t.token.logprob = field<float>(j, "logprob", "first token");
  t.token.top = top_from_json(field<json>(j, "top", "first token"));
  t.num_cached_tokens = field<int>(j, "num_cached_tokens", "first token");
  return t;
}

}  // namespace relay::disagg
