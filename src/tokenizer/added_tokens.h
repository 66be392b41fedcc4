// Cutting added tokens (<|im_start|>, <think>, ...) out of text before the model sees it, with the
// oracle's semantics: a leftmost-longest scan over all token strings (as its Aho-Corasick automaton
// in LeftmostLongest mode), where a match that is then discarded (a special token while special
// tokens are disabled, or a single_word token inside a word) still consumes its bytes; lstrip /
// rstrip widen a kept match over the white space beside it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace relay::tokenizer_detail {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = false;  // matched in normalised text (else in the raw input)
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A piece of the text: either an added token (`id` >= 0) or text for the model (`id` == -1).
struct Segment {
  uint32_t begin;
  uint32_t end;
  int32_t id;
};

class AddedTokenMatcher {
 public:
  // `patterns[i]` is the string to look for (the content, or its normalised form) for `tokens[i]`.
  AddedTokenMatcher(std::vector<AddedToken> tokens, const std::vector<std::string>& patterns);

  bool empty() const { return tokens_.empty(); }

  // Appends the segments of `text` (valid UTF-8) to `out`, covering it without gaps; with
  // skip_special, special tokens are not cut out.
  void split(std::string_view text, bool skip_special, std::vector<Segment>& out) const;

 private:
  struct Node {
    int32_t token = -1;  // index into tokens_ when a pattern ends here
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node), sorted by byte
  };
  int32_t child(int32_t node, uint8_t byte) const;

  std::vector<AddedToken> tokens_;
  std::vector<Node> trie_;
  bool first_byte_[256] = {};
};

}  // namespace relay::tokenizer_detail
