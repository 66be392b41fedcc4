// NFC normalisation exactly as Hugging Face `tokenizers` computes it.
//
// utf8proc does the work; the oracle's tables are Unicode 9, so code points whose normalisation
// data arrived later (unicode_tables::nfc_unknown) are treated as the oracle treats them: as
// unassigned starters that never combine. Such a starter blocks reordering and composition across
// it, so the text is normalised piecewise between them.
#pragma once

#include <string>
#include <string_view>

namespace relay::tokenizer_detail {

// `text` must be valid UTF-8. Appends NFC(text) to `out`.
void append_nfc(std::string_view text, std::string& out);

}  // namespace relay::tokenizer_detail
