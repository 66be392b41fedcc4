// See protocol.h.
#include "disagg/protocol.h"

#include <limits>
#include <utility>

namespace relay::disagg {

using nlohmann::json;

namespace {

// The grammar kinds by their names in the control messages.
constexpr std::pair<GrammarKind, const char*> kGrammarKinds[] = {
    {GrammarKind::kJson, "json"},
    {GrammarKind::kJsonSchema, "json_schema"},
    {GrammarKind::kJsonSchemaStrict, "json_schema_strict"},
    {GrammarKind::kRegex, "regex"},
    {GrammarKind::kChoice, "choice"},
    {GrammarKind::kEbnf, "ebnf"},
    {GrammarKind::kToolCalls, "tool_calls"},
};

const char* grammar_kind_name(GrammarKind kind) {
  for (const auto& [k, name] : kGrammarKinds) {
    if (k == kind) return name;
  }
  fail(str("request: unknown grammar kind ", static_cast<int>(kind)));
}

GrammarKind grammar_kind_from_name(const std::string& name) {
  for (const auto& [kind, n] : kGrammarKinds) {
    if (name == n) return kind;
  }
  fail(str("grammar: unknown kind \"", name, "\""));
}

// [[token, value], ...]: top logprobs, logit biases.
json pairs_to_json(const std::vector<std::pair<int32_t, float>>& pairs) {
  json out = json::array();
  for (const auto& [id, value] : pairs) out.push_back({id, value});
  return out;
}

std::vector<std::pair<int32_t, float>> pairs_from_json(const json& j, const std::string& what) {
  if (!j.is_array()) fail(str(what, ": must be a list of [token, number] pairs"));
  std::vector<std::pair<int32_t, float>> out;
  for (const json& e : j) {
    const bool token_ok = e.is_array() && e.size() == 2 && e[0].is_number_integer() &&
                          e[0].get<int64_t>() >= std::numeric_limits<int32_t>::min() &&
                          e[0].get<int64_t>() <= std::numeric_limits<int32_t>::max();
    if (!token_ok || !e[1].is_number()) fail(str(what, ": each entry must be [token, number]"));
    out.emplace_back(e[0].get<int32_t>(), e[1].get<float>());
  }
  return out;
}

json logprob_to_json(const TokenLogprob& lp) {
  return {{"token", lp.token},
          {"logprob", lp.logprob},
          {"top", pairs_to_json(lp.top)},
          {"rank", lp.rank}};
}

TokenLogprob logprob_from_json(const json& j, const char* what) {
  TokenLogprob lp;
  lp.token = field<int32_t>(j, "token", what);
  lp.logprob = field<float>(j, "logprob", what);
  lp.top = pairs_from_json(field<json>(j, "top", what), str(what, ": field \"top\""));
  // Older messages carry no rank: 0, unknown.
  if (j.contains("rank")) lp.rank = field<int32_t>(j, "rank", what);
  return lp;
}

// One entry per prompt position: null where nothing was scored (the first), else the row.
json prompt_logprobs_to_json(const std::vector<std::optional<TokenLogprob>>& rows) {
  json out = json::array();
  for (const std::optional<TokenLogprob>& row : rows) {
    out.push_back(row ? logprob_to_json(*row) : json(nullptr));
  }
  return out;
}

std::vector<std::optional<TokenLogprob>> prompt_logprobs_from_json(const json& j,
                                                                   const char* what) {
  if (!j.is_array()) fail(str(what, ": field \"prompt_logprobs\" must be a list"));
  std::vector<std::optional<TokenLogprob>> rows;
  for (const json& row : j) {
    if (row.is_null()) {
      rows.emplace_back();
    } else {
      rows.emplace_back(logprob_from_json(row, "prompt logprob"));
    }
  }
  return rows;
}

FinishReason finish_from_name(const std::string& name) {
  for (FinishReason r :
       {FinishReason::kNone, FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort}) {
    if (name == finish_reason_name(r)) return r;
  }
  fail(str("output: unknown finish reason \"", name, "\""));
}

}  // namespace

json request_to_json(const EngineRequest& r) {
  const SamplingParams& s = r.sampling;
  const StopConditions& c = r.stop;
  json j = {{"prompt", r.prompt},
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
              {"skip_special_tokens", c.skip_special_tokens}}},
            {"num_prompt_logprobs", r.num_prompt_logprobs},
            {"logit_bias", pairs_to_json(r.logit_bias)},
            {"reasoning",
             {{"open", r.reasoning.open},
              {"close", r.reasoning.close},
              {"starts_inside", r.reasoning.starts_inside}}}};
  if (r.grammar) {
    const GrammarSpec& g = grammar_spec(*r.grammar);
    j["grammar"] = {{"kind", grammar_kind_name(g.kind)}, {"text", g.text}};
  }
  return j;
}

EngineRequest request_from_json(const json& j, const CompileGrammar& compile) {
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
  // NOTE: the fields below came later; a message from an older router has none of them, which
  // means what their absence says (no prompt logprobs, no constraints).
  if (j.contains("num_prompt_logprobs"))
    r.num_prompt_logprobs = field<int>(j, "num_prompt_logprobs", "request");
  if (j.contains("logit_bias")) {
    r.logit_bias =
        pairs_from_json(field<json>(j, "logit_bias", "request"), "request: field \"logit_bias\"");
  }
  if (j.contains("reasoning")) {
    const json g = field<json>(j, "reasoning", "request");
    r.reasoning.open = field<int32_t>(g, "open", "reasoning");
    r.reasoning.close = field<int32_t>(g, "close", "reasoning");
    r.reasoning.starts_inside = field<bool>(g, "starts_inside", "reasoning");
  }
  if (j.contains("grammar")) {
    const json g = field<json>(j, "grammar", "request");
    const GrammarSpec spec{grammar_kind_from_name(field<std::string>(g, "kind", "grammar")),
                           field<std::string>(g, "text", "grammar")};
    try {
      r.grammar = compile(spec);
    } catch (const Error& e) {
      fail(str("grammar: ", e.what()));
    }
  }
  return r;
}

json output_to_json(const RequestOutput& o) {
  json logprobs = json::array();
  for (const TokenLogprob& lp : o.logprobs) logprobs.push_back(logprob_to_json(lp));
  json out = {{"id", o.id},
              {"new_tokens", o.new_tokens},
              {"text", o.text},
              {"logprobs", logprobs},
              {"finish", finish_reason_name(o.finish)},
              {"num_prompt_tokens", o.num_prompt_tokens},
              {"num_output_tokens", o.num_output_tokens},
              {"num_cached_tokens", o.num_cached_tokens},
              {"queue_time_s", o.queue_time_s}};
  if (!o.prompt_logprobs.empty())
    out["prompt_logprobs"] = prompt_logprobs_to_json(o.prompt_logprobs);
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
    o.logprobs.push_back(logprob_from_json(lp, "logprob"));
  }
  if (j.contains("prompt_logprobs"))
    o.prompt_logprobs = prompt_logprobs_from_json(j.at("prompt_logprobs"), "output");
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
  json j = logprob_to_json(t.token);
  j["num_cached_tokens"] = t.num_cached_tokens;
  if (!t.prompt_logprobs.empty()) j["prompt_logprobs"] = prompt_logprobs_to_json(t.prompt_logprobs);
  return j;
}

FirstToken first_token_from_json(const json& j) {
  FirstToken t;
  static_cast<TokenLogprob&>(t.token) = logprob_from_json(j, "first token");
  t.num_cached_tokens = field<int>(j, "num_cached_tokens", "first token");
  if (j.contains("prompt_logprobs"))
    t.prompt_logprobs = prompt_logprobs_from_json(j.at("prompt_logprobs"), "first token");
  return t;
}

}  // namespace relay::disagg
