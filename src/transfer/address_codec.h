// The text pieces transports build their region addresses from (region.h: RegionDescriptor's
// opaque `address`): binary blobs as lower-case hex, and colon-separated fields.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace relay {

// Two lower-case hex digits per byte.
std::string to_hex(const void* data, size_t bytes);
// The bytes of `hex` (two hex digits per byte, non-empty); false, leaving `out` unspecified, on
// anything else.
bool from_hex(std::string_view hex, std::string& out);
// `text` cut at every colon ("a::b" gives "a", "", "b"); views into `text`.
std::vector<std::string_view> split_fields(std::string_view text);

}  // namespace relay
