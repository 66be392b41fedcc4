// JSON for region descriptors (the control plane sends them in worker announcements) and the field
// readers every descriptor's from_json shares.
#include "transfer/region.h"

#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace relay {

bool is_json_u64(const nlohmann::json& value) {
  return value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
}

int json_int_field(const nlohmann::json& j, const char* key, std::string_view what) {
  // NOTE: range-checked, since get<int>() would silently truncate a larger integer.
  const bool fits = j.contains(key) && j.at(key).is_number_integer() &&
                    (j.at(key).is_number_unsigned()
                         ? j.at(key).get<uint64_t>() <= std::numeric_limits<int>::max()
                         : j.at(key).get<int64_t>() >= std::numeric_limits<int>::min() &&
                               j.at(key).get<int64_t>() <= std::numeric_limits<int>::max());
  RELAY_CHECK(fits, what, " field '", key, "' must be a 32-bit integer");
  return j.at(key).get<int>();
}

uint64_t json_u64_field(const nlohmann::json& j, const char* key, std::string_view what) {
  RELAY_CHECK(j.contains(key) && is_json_u64(j.at(key)), what, " field '", key,
              "' must be a non-negative integer");
  return j.at(key).get<uint64_t>();
}

void to_json(nlohmann::json& j, const RegionDescriptor& desc) {
  j = nlohmann::json{{"id", desc.id},
                     {"bytes", desc.bytes},
                     {"transport", desc.transport},
                     {"address", desc.address}};
}

void from_json(const nlohmann::json& j, RegionDescriptor& desc) {
  RELAY_CHECK(j.is_object(), "region descriptor must be a JSON object, got ", j.dump());
  for (const char* key : {"id", "bytes"}) {
    RELAY_CHECK(j.contains(key) && is_json_u64(j.at(key)), "region descriptor field '", key,
                "' must be a non-negative integer in ", j.dump());
  }
  for (const char* key : {"transport", "address"}) {
    RELAY_CHECK(j.contains(key) && j.at(key).is_string(), "region descriptor field '", key,
                "' must be a string in ", j.dump());
  }
  desc.id = j.at("id").get<RegionId>();
  desc.bytes = j.at("bytes").get<uint64_t>();
  desc.transport = j.at("transport").get<std::string>();
  desc.address = j.at("address").get<std::string>();
}

}  // namespace relay
