// The in-process transport (see in_process_transport.h).
#include "transfer/in_process_transport.h"

#include <unistd.h>

#include <charconv>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "core/error.h"

namespace relay {

namespace {

class InProcessTransport final : public Transport {
 public:
  std::string_view name() const override { return "in_process"; }

  std::string add_local_region(RegionId id, std::byte* base, uint64_t /*bytes*/) override {
    std::unique_lock lock(mutex_);
    bases_[id] = base;
    return str(::getpid(), ":0x", std::hex, reinterpret_cast<uintptr_t>(base));
  }

  void add_remote_region(const RegionDescriptor& desc) override {
    std::byte* base = parse_address(desc);
    std::unique_lock lock(mutex_);
    bases_[desc.id] = base;
  }

  void remove_region(RegionId id) override {
    std::unique_lock lock(mutex_);
    bases_.erase(id);
  }

  void post(const TransferCopy& copy) override {
    std::byte* src = nullptr;
    std::byte* dst = nullptr;
    {
      std::shared_lock lock(mutex_);
      src = bases_.at(copy.src_region);
      dst = bases_.at(copy.dst_region);
    }
    std::memcpy(dst + copy.dst_offset_bytes, src + copy.src_offset_bytes, copy.bytes);
  }

  void wait_posted() override {}

 private:
  // "<pid>:0x<hex>" -> pointer, refusing another process's regions.
  static std::byte* parse_address(const RegionDescriptor& desc) {
    const std::string& a = desc.address;
    const size_t colon = a.find(":0x");
    long pid = 0;
    uintptr_t pointer = 0;
    const bool ok = colon != std::string::npos &&
                    std::from_chars(a.data(), a.data() + colon, pid).ptr == a.data() + colon &&
                    std::from_chars(a.data() + colon + 3, a.data() + a.size(), pointer, 16).ptr ==
                        a.data() + a.size() &&
                    pointer != 0;
    RELAY_CHECK(ok, "region ", desc.id, " has a malformed in-process address '", a, "'");
    RELAY_CHECK(pid == ::getpid(), "region ", desc.id, " belongs to process ", pid,
                "; the in-process transport only reaches process ", ::getpid());
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the text is a pointer this process exported.
    return reinterpret_cast<std::byte*>(pointer);
  }

  std::shared_mutex mutex_;
  std::unordered_map<RegionId, std::byte*> bases_;
};

}  // namespace

std::unique_ptr<Transport> make_in_process_transport() {
  return std::make_unique<InProcessTransport>();
}

}  // namespace relay
