// Relay's tokenizer: the byte-level BPE of Qwen3's tokenizer.json, exact against Hugging Face
// `tokenizers` (encode with add_special_tokens=False, decode), plus a streaming detokenizer.
//
// Encoding follows the oracle's pipeline: added tokens are cut out first (leftmost-longest,
// honouring special / normalized / lstrip / rstrip / single_word), the rest is NFC-normalised,
// split by the pre-tokenizer regex and BPE-merged per piece. Invalid UTF-8 input is first repaired
// to U+FFFD per ill-formed subsequence (as Python's bytes.decode(errors='replace')). Only the
// configurations Relay implements exactly are accepted; anything else fails at load with the file
// and field named.
//
// A Tokenizer is immutable after loading and safe to use from many threads; copies are cheap and
// share the loaded tables. This header is included by the server and the engine, so it stays small:
// everything else lives behind the pointer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace relay {

class Tokenizer {
 public:
  // Loads a tokenizer.json. Throws relay::Error naming the file (and field) when it is missing,
  // malformed or uses a component Relay does not implement.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // Loads `<model_dir>/tokenizer.json`.
  static Tokenizer from_model_dir(const std::string& model_dir);

  // Token ids of `text` (any bytes; invalid UTF-8 is repaired first). With allow_special false,
  // special added tokens in the text are encoded as plain text (the oracle's
  // encode_special_tokens); non-special added tokens such as <think> are still recognised, as in
  // the oracle.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;

  // The text of `ids`, as the oracle's decode: ids without a token are skipped, byte sequences that
  // are not valid UTF-8 become U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token's string as written in tokenizer.json (byte-level alphabet for BPE tokens); valid for
  // the lifetime of this Tokenizer (or any copy of it).
  std::optional<std::string_view> id_to_token(int32_t id) const;
  // The raw bytes `id` decodes to (may be a fragment of a UTF-8 character); empty for unknown ids.
  std::string_view token_bytes(int32_t id) const;

  // Number of distinct tokens including added ones (the oracle's get_vocab_size(True)). The
  // model's embedding may be larger (padding rows); such ids decode to nothing.
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;
  // Ids of the added tokens marked special, ascending.
  std::vector<int32_t> special_token_ids() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Turns a stream of ids (one at a time, as the engine samples them) into text that never ends in
// half a character: bytes of an incomplete UTF-8 sequence are held back until the sequence
// completes. The concatenation of every push() and the final flush() equals
// tokenizer.decode(all ids, skip_special_tokens).
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  // Text that became complete with `id` (often empty while a character is split across tokens).
  std::string push(int32_t id);
  // What is still held back, with U+FFFD for an incomplete sequence; call at the end of the stream.
  std::string flush();
  // Bytes currently held back (0 to 3).
  size_t num_pending_bytes() const { return pending_.size(); }

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace relay
