// Loading tokenizer.json and running the encode / decode pipelines (see tokenizer.h).
//
// Loading checks every field that changes token ids and refuses what Relay does not implement, so a
// tokenizer that loads is one Relay encodes exactly. The ByteLevel alphabet (GPT-2's
// bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes take
// U+0100..U+0143 in order) is undone once at load: BPE runs on raw bytes and every id keeps the
// bytes it decodes to.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/split_regex.h"
#include "tokenizer/utf8.h"

namespace relay {

using json = nlohmann::json;
using namespace tokenizer_detail;

namespace {

// byte -> code point of the ByteLevel alphabet.
std::array<uint32_t, 256> byte_level_alphabet() {
  std::array<uint32_t, 256> cps{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cps[b] = printable ? b : next++;
  }
  return cps;
}

// The bytes a token stands for, as the oracle's ByteLevel decoder computes them: every character
// mapped back through the alphabet, or the token's own UTF-8 when any character is outside it.
std::string token_to_bytes(std::string_view token,
                           const std::unordered_map<uint32_t, uint8_t>& alphabet) {
  std::string bytes;
  size_t pos = 0;
  while (pos < token.size()) {
    const size_t n = utf8::sequence_length(token, pos);
    const auto it = n == 0 ? alphabet.end() : alphabet.find(utf8::decode_at(token, pos, n));
    if (it == alphabet.end()) return std::string(token);
    bytes.push_back(static_cast<char>(it->second));
    pos += n;
  }
  return bytes;
}

// Field access that names the file and the field on failure.
class Fields {
 public:
  explicit Fields(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail_at(const std::string& field, const std::string& message) const {
    fail(str(path_, ": ", field, ": ", message));
  }

  const json& get(const json& object, const char* key, const std::string& field) const {
    if (!object.is_object() || !object.contains(key)) fail_at(field, "missing");
    return object.at(key);
  }

  std::string string_of(const json& value, const std::string& field) const {
    if (!value.is_string()) fail_at(field, str("expected a string, got ", value.type_name()));
    return value.get<std::string>();
  }

  bool bool_of(const json& object, const char* key, const std::string& field, bool fallback) const {
    if (!object.contains(key) || object.at(key).is_null()) return fallback;
    if (!object.at(key).is_boolean()) fail_at(field, "expected true or false");
    return object.at(key).get<bool>();
  }

  std::string type_of(const json& component, const std::string& field) const {
    return string_of(get(component, "type", field + ".type"), field + ".type");
  }

  // A string option that must be null, absent or one of `allowed`.
  void require_empty_string(const json& object, const char* key, const std::string& field) const {
    if (!object.contains(key) || object.at(key).is_null()) return;
    if (string_of(object.at(key), field) != "")
      fail_at(field, "must be empty or null (Relay does not implement it)");
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

SplitBehavior parse_behavior(const std::string& name, const Fields& f, const std::string& field) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  f.fail_at(field, str("unknown split behavior '", name, "'"));
}

}  // namespace

struct Tokenizer::Impl {
  enum class Kind : uint8_t { None, Model, Added, Special };

  std::unordered_map<std::string, int32_t> model_vocab;  // token string -> id
  std::unordered_map<std::string, int32_t> added_ids;    // added token content -> id
  std::vector<std::string> id_token;                     // id -> token string
  std::vector<std::string> id_bytes;                     // id -> bytes it decodes to
  std::vector<Kind> id_kind;
  int32_t vocab_size = 0;

  bool nfc = false;
  std::unique_ptr<AddedTokenMatcher> raw_added;         // tokens matched in the input
  std::unique_ptr<AddedTokenMatcher> normalized_added;  // tokens matched after normalisation
  std::vector<std::unique_ptr<SplitRegex>> splits;      // pre-tokenizer steps, in order
  std::unique_ptr<BpeModel> bpe;

  void set_id(int32_t id, const std::string& token, Kind kind,
              const std::unordered_map<uint32_t, uint8_t>& alphabet) {
    if (size_t(id) >= id_token.size()) {
      id_token.resize(size_t(id) + 1);
      id_bytes.resize(size_t(id) + 1);
      id_kind.resize(size_t(id) + 1, Kind::None);
    }
    id_token[size_t(id)] = token;
    id_bytes[size_t(id)] = token_to_bytes(token, alphabet);
    id_kind[size_t(id)] = kind;
  }

  void encode_text(std::string_view text, std::vector<int32_t>& ids) const;
  void encode_normalized(std::string_view text, std::vector<int32_t>& ids) const;
};

// Pre-tokenizes and BPE-encodes normalised text that holds no added token.
void Tokenizer::Impl::encode_normalized(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<Span> pieces{{0, uint32_t(text.size())}};
  std::vector<Span> next;
  for (const auto& split : splits) {
    next.clear();
    for (const Span& piece : pieces) {
      const size_t first = next.size();
      split->split(text.substr(piece.begin, piece.end - piece.begin), next);
      for (size_t k = first; k < next.size(); ++k) {
        next[k].begin += piece.begin;
        next[k].end += piece.begin;
      }
    }
    pieces.swap(next);
  }
  for (const Span& piece : pieces) {
    if (piece.end > piece.begin)
      bpe->encode_word(text.substr(piece.begin, piece.end - piece.begin), ids);
  }
}

// Normalises a stretch of input between raw added tokens, then cuts normalised added tokens.
void Tokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>& ids) const {
  std::string normalized;
  std::string_view view = text;
  if (nfc) {
    append_nfc(text, normalized);
    view = normalized;
  }
  if (normalized_added == nullptr) {
    encode_normalized(view, ids);
    return;
  }
  std::vector<Segment> segments;
  normalized_added->split(view, /*skip_special=*/false, segments);
  for (const Segment& s : segments) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else {
      encode_normalized(view.substr(s.begin, s.end - s.begin), ids);
    }
  }
}

Tokenizer Tokenizer::from_model_dir(const std::string& model_dir) {
  return from_file((std::filesystem::path(model_dir) / "tokenizer.json").string());
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  const json root = parse_json_file(path);
  const Fields f(path);
  if (!root.is_object()) f.fail_at("(top level)", "expected an object");

  auto impl = std::make_shared<Impl>();
  const std::array<uint32_t, 256> alphabet_cps = byte_level_alphabet();
  std::unordered_map<uint32_t, uint8_t> alphabet;
  for (uint32_t b = 0; b < 256; ++b) alphabet[alphabet_cps[b]] = uint8_t(b);

  for (const char* key : {"truncation", "padding"}) {
    if (root.contains(key) && !root.at(key).is_null())
      f.fail_at(key, "must be null (Relay does not truncate or pad)");
  }

  // The model: BPE over the byte-level alphabet.
  const json& model = f.get(root, "model", "model");
  const std::string model_type = f.type_of(model, "model");
  if (model_type != "BPE")
    f.fail_at("model.type", str("'", model_type, "' is not supported (Relay implements BPE)"));
  if (model.contains("dropout") && !model.at("dropout").is_null()) {
    f.fail_at("model.dropout", "must be null (BPE dropout is random)");
  }
  f.require_empty_string(model, "continuing_subword_prefix", "model.continuing_subword_prefix");
  f.require_empty_string(model, "end_of_word_suffix", "model.end_of_word_suffix");
  const bool ignore_merges = f.bool_of(model, "ignore_merges", "model.ignore_merges", false);
  const json& vocab = f.get(model, "vocab", "model.vocab");
  if (!vocab.is_object()) f.fail_at("model.vocab", "expected an object of token -> id");
  impl->model_vocab.reserve(vocab.size());
  for (const auto& [token, id_value] : vocab.items()) {
    if (!id_value.is_number_integer() || id_value.get<int64_t>() < 0 ||
        id_value.get<int64_t>() > INT32_MAX) {
      f.fail_at(str("model.vocab[\"", token, "\"]"), "expected a non-negative 32-bit id");
    }
    const auto id = id_value.get<int32_t>();
    impl->model_vocab.emplace(token, id);
    impl->set_id(id, token, Impl::Kind::Model, alphabet);
  }
  std::array<int32_t, 256> byte_ids{};
  for (uint32_t b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(ch, alphabet_cps[b]);
    const auto it = impl->model_vocab.find(ch);
    if (it == impl->model_vocab.end()) {
      f.fail_at("model.vocab", str("lacks the byte-level token '", ch, "' for byte ", b,
                                   " (not a byte-level BPE vocab)"));
    }
    byte_ids[b] = it->second;
  }
  const json& merges_json = f.get(model, "merges", "model.merges");
  if (!merges_json.is_array()) f.fail_at("model.merges", "expected an array");
  std::vector<std::array<int32_t, 3>> merges;
  merges.reserve(merges_json.size());
  const auto vocab_id = [&](const std::string& token, const std::string& field) {
    const auto it = impl->model_vocab.find(token);
    if (it == impl->model_vocab.end())
      f.fail_at(field, str("token '", token, "' is not in model.vocab"));
    return it->second;
  };
  for (size_t i = 0; i < merges_json.size(); ++i) {
    const json& m = merges_json[i];
    const std::string field = str("model.merges[", i, "]");
    std::string left, right;
    if (m.is_string()) {
      const std::string line = m.get<std::string>();
      if (line.starts_with("#version")) continue;  // a merges.txt header the oracle also skips
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        f.fail_at(field, str("'", line, "' is not two tokens separated by one space"));
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      f.fail_at(field, "expected \"left right\" or [left, right]");
    }
    merges.push_back(
        {vocab_id(left, field), vocab_id(right, field), vocab_id(left + right, field)});
  }
  std::vector<std::pair<std::string, int32_t>> whole_words;
  if (ignore_merges) {
    for (const auto& [token, id] : impl->model_vocab)
      whole_words.emplace_back(token_to_bytes(token, alphabet), id);
  }
  impl->bpe = std::make_unique<BpeModel>(byte_ids, merges, whole_words);

  // Added tokens. Ids are assigned as the oracle assigns them (a token already in the vocab keeps
  // its id, a new one takes the next id after the vocab); a file that says otherwise is refused
  // rather than silently renumbered.
  std::vector<AddedToken> added;
  if (root.contains("added_tokens") && !root.at("added_tokens").is_null()) {
    const json& list = root.at("added_tokens");
    if (!list.is_array()) f.fail_at("added_tokens", "expected an array");
    int32_t next_new_id = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string field = str("added_tokens[", i, "]");
      const json& t = list[i];
      AddedToken token;
      token.content = f.string_of(f.get(t, "content", field + ".content"), field + ".content");
      const json& id_value = f.get(t, "id", field + ".id");
      if (!id_value.is_number_integer() || id_value.get<int64_t>() < 0 ||
          id_value.get<int64_t>() > INT32_MAX) {
        f.fail_at(field + ".id", "expected a non-negative 32-bit id");
      }
      token.id = id_value.get<int32_t>();
      token.special = f.bool_of(t, "special", field + ".special", false);
      token.normalized = f.bool_of(t, "normalized", field + ".normalized", !token.special);
      token.lstrip = f.bool_of(t, "lstrip", field + ".lstrip", false);
      token.rstrip = f.bool_of(t, "rstrip", field + ".rstrip", false);
      token.single_word = f.bool_of(t, "single_word", field + ".single_word", false);
      if (token.content.empty()) continue;  // the oracle ignores empty added tokens
      if (!utf8::is_valid(token.content)) f.fail_at(field + ".content", "is not valid UTF-8");
      if (const auto it = impl->added_ids.find(token.content); it != impl->added_ids.end()) {
        // The oracle ignores a repeated token (its first flags stay); the id must still agree.
        if (token.id != it->second)
          f.fail_at(field + ".id", str("repeats '", token.content, "' with another id"));
        continue;
      }
      int32_t expected = -1;
      if (const auto v = impl->model_vocab.find(token.content); v != impl->model_vocab.end()) {
        expected = v->second;
      } else {
        expected = std::max(next_new_id, int32_t(vocab.size()));
        next_new_id = expected + 1;
      }
      if (token.id != expected) {
        f.fail_at(field + ".id",
                  str(token.id, " for '", token.content, "' differs from the id ", expected,
                      " Hugging Face assigns (vocab size ", vocab.size(), ", added in order)"));
      }
      impl->added_ids.emplace(token.content, token.id);
      impl->set_id(token.id, token.content, token.special ? Impl::Kind::Special : Impl::Kind::Added,
                   alphabet);
      added.push_back(std::move(token));
    }
  }
  impl->vocab_size = int32_t(impl->model_vocab.size());
  for (const auto& [token, id] : impl->added_ids)
    impl->vocab_size += impl->model_vocab.contains(token) ? 0 : 1;

  // Normalizer: NFC or nothing.
  if (root.contains("normalizer") && !root.at("normalizer").is_null()) {
    const json& n = root.at("normalizer");
    const std::string type = f.type_of(n, "normalizer");
    if (type == "NFC") {
      impl->nfc = true;
    } else if (type == "Sequence") {
      const json& list = f.get(n, "normalizers", "normalizer.normalizers");
      for (size_t i = 0; i < list.size(); ++i) {
        const std::string field = str("normalizer.normalizers[", i, "]");
        const std::string t = f.type_of(list[i], field);
        if (t != "NFC")
          f.fail_at(field + ".type", str("'", t, "' is not supported (Relay implements NFC)"));
        impl->nfc = true;
      }
    } else {
      f.fail_at("normalizer.type", str("'", type, "' is not supported (Relay implements NFC)"));
    }
  }

  // Added tokens split in two groups, as in the oracle: normalized ones are looked for in the
  // normalised text (their own content normalised too), the others in the raw input.
  {
    std::vector<AddedToken> raw, norm;
    std::vector<std::string> raw_patterns, norm_patterns;
    // The oracle lists special tokens before the other added tokens.
    std::stable_partition(added.begin(), added.end(),
                          [](const AddedToken& t) { return t.special; });
    for (AddedToken& t : added) {
      if (t.normalized) {
        std::string pattern;
        if (impl->nfc) {
          append_nfc(t.content, pattern);
        } else {
          pattern = t.content;
        }
        norm_patterns.push_back(std::move(pattern));
        norm.push_back(std::move(t));
      } else {
        raw_patterns.push_back(t.content);
        raw.push_back(std::move(t));
      }
    }
    if (!raw.empty())
      impl->raw_added = std::make_unique<AddedTokenMatcher>(std::move(raw), raw_patterns);
    if (!norm.empty())
      impl->normalized_added = std::make_unique<AddedTokenMatcher>(std::move(norm), norm_patterns);
  }

  // Pre-tokenizer: Split steps, then ByteLevel (which only maps bytes, done implicitly).
  {
    const json* pre = root.contains("pre_tokenizer") ? &root.at("pre_tokenizer") : nullptr;
    if (pre == nullptr || pre->is_null())
      f.fail_at("pre_tokenizer", "missing (Relay needs a ByteLevel pre-tokenizer)");
    std::vector<std::pair<const json*, std::string>> steps;
    if (f.type_of(*pre, "pre_tokenizer") == "Sequence") {
      const json& list = f.get(*pre, "pretokenizers", "pre_tokenizer.pretokenizers");
      for (size_t i = 0; i < list.size(); ++i)
        steps.emplace_back(&list[i], str("pre_tokenizer.pretokenizers[", i, "]"));
    } else {
      steps.emplace_back(pre, "pre_tokenizer");
    }
    bool byte_level = false;
    for (const auto& [step, field] : steps) {
      const std::string type = f.type_of(*step, field);
      if (byte_level)
        f.fail_at(field, "must not follow ByteLevel (Relay runs splits on the original text)");
      if (type == "ByteLevel") {
        if (f.bool_of(*step, "add_prefix_space", field + ".add_prefix_space", true)) {
          f.fail_at(field + ".add_prefix_space",
                    "must be false (Relay does not add a prefix space)");
        }
        if (f.bool_of(*step, "use_regex", field + ".use_regex", true)) {
          f.fail_at(field + ".use_regex", "must be false (give the regex as a Split step)");
        }
        byte_level = true;
      } else if (type == "Split") {
        const json& pattern = f.get(*step, "pattern", field + ".pattern");
        std::string text;
        bool literal = false;
        if (pattern.is_object() && pattern.contains("Regex")) {
          text = f.string_of(pattern.at("Regex"), field + ".pattern.Regex");
        } else if (pattern.is_object() && pattern.contains("String")) {
          text = f.string_of(pattern.at("String"), field + ".pattern.String");
          literal = true;
        } else {
          f.fail_at(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
        }
        const SplitBehavior behavior = parse_behavior(
            f.string_of(f.get(*step, "behavior", field + ".behavior"), field + ".behavior"), f,
            field + ".behavior");
        const bool invert = f.bool_of(*step, "invert", field + ".invert", false);
        impl->splits.push_back(std::make_unique<SplitRegex>(text, literal, behavior, invert,
                                                            str(path, ": ", field, ".pattern")));
      } else {
        f.fail_at(field + ".type",
                  str("'", type, "' is not supported (Relay implements Split and ByteLevel)"));
      }
    }
    if (!byte_level)
      f.fail_at("pre_tokenizer", "has no ByteLevel step (Relay implements byte-level BPE)");
  }

  if (root.contains("post_processor") && !root.at("post_processor").is_null()) {
    const std::string type = f.type_of(root.at("post_processor"), "post_processor");
    if (type != "ByteLevel") {
      f.fail_at(
          "post_processor.type",
          str("'", type, "' is not supported (Relay implements ByteLevel, which adds no tokens)"));
    }
  }
  const json& decoder = f.get(root, "decoder", "decoder");
  if (decoder.is_null() || f.type_of(decoder, "decoder") != "ByteLevel") {
    f.fail_at("decoder", "must be ByteLevel (Relay implements the byte-level decoder)");
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool allow_special) const {
  std::string repaired;
  if (!utf8::is_valid(text)) {
    repaired = utf8::sanitize(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  if (impl_->raw_added == nullptr) {
    impl_->encode_text(text, ids);
    return ids;
  }
  std::vector<Segment> segments;
  impl_->raw_added->split(text, /*skip_special=*/!allow_special, segments);
  for (const Segment& s : segments) {
    if (s.id >= 0) {
      ids.push_back(s.id);
    } else {
      impl_->encode_text(text.substr(s.begin, s.end - s.begin), ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bytes.append(token_bytes(id));
  }
  return utf8::is_valid(bytes) ? bytes : utf8::sanitize(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (const auto it = impl_->added_ids.find(key); it != impl_->added_ids.end()) return it->second;
  if (const auto it = impl_->model_vocab.find(key); it != impl_->model_vocab.end())
    return it->second;
  return std::nullopt;
}

std::optional<std::string_view> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_kind.size() ||
      impl_->id_kind[size_t(id)] == Impl::Kind::None) {
    return std::nullopt;
  }
  return impl_->id_token[size_t(id)];
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_bytes.size()) return {};
  return impl_->id_bytes[size_t(id)];
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->id_kind.size() &&
         impl_->id_kind[size_t(id)] == Impl::Kind::Special;
}

std::vector<int32_t> Tokenizer::special_token_ids() const {
  std::vector<int32_t> ids;
  for (size_t id = 0; id < impl_->id_kind.size(); ++id) {
    if (impl_->id_kind[id] == Impl::Kind::Special) ids.push_back(int32_t(id));
  }
  return ids;
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_.is_special(id)) return {};
  pending_.append(tokenizer_.token_bytes(id));
  const size_t held = utf8::incomplete_tail_length(pending_);
  const std::string_view ready = std::string_view(pending_).substr(0, pending_.size() - held);
  std::string text = utf8::is_valid(ready) ? std::string(ready) : utf8::sanitize(ready);
  pending_.erase(0, pending_.size() - held);
  return text;
}

std::string IncrementalDetokenizer::flush() {
  std::string text = utf8::sanitize(pending_);
  pending_.clear();
  return text;
}

}  // namespace relay
