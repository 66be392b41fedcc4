// JSON for region descriptors (the control plane sends them in worker announcements).
#include "transfer/region.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace relay {

bool is_json_u64(const nlohmann::json& value) {
  return value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
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
