// See forward_batch.h.
#include "model/forward_batch.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

void FlatBatch::reset(int w) {
  token_ids.clear();
  positions.clear();
  query_starts.assign(1, 0);
  context_lens.clear();
  block_tables.clear();
  logit_rows.clear();
  slot_mapping.clear();
  width = w;
}

int32_t FlatBatch::append(std::span<const int32_t> tokens, int32_t num_computed,
                          std::span<const int32_t> table, int block_size, int fillers) {
  RELAY_CHECK(static_cast<int>(table.size()) <= width, "a block table of ", table.size(),
              " blocks in a batch ", width, " wide");
  const int32_t first = query_starts.back();
  for (size_t j = 0; j < tokens.size(); ++j) {
    const int32_t pos = num_computed + static_cast<int32_t>(j);
    token_ids.push_back(tokens[j]);
    positions.push_back(pos);
    slot_mapping.push_back(int64_t{table[pos / block_size]} * block_size + pos % block_size);
  }
  const int32_t context = num_computed + static_cast<int32_t>(tokens.size());
  for (int f = 0; f < fillers; ++f) {
    token_ids.push_back(0);
    positions.push_back(context + f);
    slot_mapping.push_back(-1);
  }
  query_starts.push_back(static_cast<int32_t>(token_ids.size()));
  context_lens.push_back(context + fillers);
  block_tables.insert(block_tables.end(), table.begin(), table.end());
  block_tables.resize(block_tables.size() + (width - table.size()), 0);
  return first;
}

void FlatBatch::append_padding(int rows) {
  for (int j = 0; j < rows; ++j) {
    token_ids.push_back(0);
    positions.push_back(j);
    slot_mapping.push_back(-1);
  }
  query_starts.push_back(static_cast<int32_t>(token_ids.size()));
  context_lens.push_back(rows);
  block_tables.resize(block_tables.size() + width, 0);
}

ForwardBatch FlatBatch::view() const {
  return ForwardBatch{token_ids,    positions, query_starts, context_lens,
                      block_tables, width,     slot_mapping, logit_rows};
}

}  // namespace relay
