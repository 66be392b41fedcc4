// Memory regions and the copies between them: the plain data shared by the layout mapper (what to
// copy) and the transfer engine (how to copy it).
//
// A region is a range of bytes registered with a transfer engine under a RegionId chosen by its
// owner. Ids must be unique across every engine that will exchange copies (the control plane hands
// them out, e.g. a worker index in the high bits), because copies name regions by id and byte
// offset — never by pointer — so a copy list computed on one machine means the same thing on
// another. The owner exports a RegionDescriptor (id, size, the transport that reaches the region
// and that transport's opaque address: a pointer in-process, a CUDA IPC handle, a UCX remote key),
// which travels as JSON to peers, who import it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace relay {

using RegionId = uint64_t;

struct RegionDescriptor {
  RegionId id = 0;
  uint64_t bytes = 0;
  std::string transport;  // name of the transport that can reach the region ("in_process", ...)
  std::string address;    // that transport's opaque address of the region's first byte
};

// JSON form: {"id": 7, "bytes": 4096, "transport": "in_process", "address": "..."}.
void to_json(nlohmann::json& j, const RegionDescriptor& desc);
// Throws relay::Error naming the missing or mistyped field.
void from_json(const nlohmann::json& j, RegionDescriptor& desc);

// Whether a JSON value is an integer that fits uint64_t (nlohmann keeps integers built in code as
// signed and parsed non-negative ones as unsigned; descriptors accept both).
bool is_json_u64(const nlohmann::json& value);

// Field `key` of descriptor object `j`, for the descriptors' from_json. Throws relay::Error
// "<what> field '<key>' must be ..." when it is missing, mistyped or out of range.
int json_int_field(const nlohmann::json& j, const char* key, std::string_view what);
uint64_t json_u64_field(const nlohmann::json& j, const char* key, std::string_view what);

// One contiguous copy: bytes [src_offset_bytes, src_offset_bytes + bytes) of src_region land at
// dst_offset_bytes of dst_region. The source is always local to the engine that executes the copy
// (writes are pushed).
struct TransferCopy {
  RegionId src_region = 0;
  uint64_t src_offset_bytes = 0;
  RegionId dst_region = 0;
  uint64_t dst_offset_bytes = 0;
  uint64_t bytes = 0;
};

}  // namespace relay
