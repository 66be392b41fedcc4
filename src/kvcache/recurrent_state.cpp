// See recurrent_state.h for the layout.
#include "kvcache/recurrent_state.h"

#include <algorithm>

#include "core/error.h"

namespace relay {

RecurrentStatePool::RecurrentStatePool(const RecurrentStateLayout& layout) : layout_(layout) {
  RELAY_CHECK(layout.element_bytes == sizeof(float),
              "the CPU recurrent-state pool stores fp32, got element size ", layout.element_bytes);
  RELAY_CHECK(layout.num_layers > 0 && layout.num_slots > 0 && layout.conv_dim > 0 &&
                  layout.conv_width >= 0 && layout.num_heads > 0 && layout.key_dim > 0 &&
                  layout.value_dim > 0,
              "recurrent-state pool needs positive sizes (layers ", layout.num_layers, ", slots ",
              layout.num_slots, ", conv_dim ", layout.conv_dim, ", heads ", layout.num_heads, ")");
  data_.assign(static_cast<size_t>(layout.num_elements()), 0.0f);
}

void RecurrentStatePool::copy_slot(int dst, int src) {
  RELAY_CHECK(dst >= 0 && dst < layout_.num_slots && src >= 0 && src < layout_.num_slots,
              "recurrent-state copy from slot ", src, " to slot ", dst, ": the pool has ",
              layout_.num_slots);
  if (dst == src) return;
  const int64_t n = layout_.slot_stride();
  std::copy_n(data_.data() + src * n, n, data_.data() + dst * n);
}

}  // namespace relay
