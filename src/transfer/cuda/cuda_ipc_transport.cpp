// See cuda_ipc_transport.h.
#include "transfer/cuda/cuda_ipc_transport.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "transfer/address_codec.h"

namespace relay {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(str("CUDA IPC transport: ", what, ": ", cudaGetErrorString(e)));
}

// Address: "cudaipc:<pid>:<device>:<hex handle>:<offset in the allocation>".
struct Address {
  long pid = 0;
  int device = 0;
  cudaIpcMemHandle_t handle{};
  uint64_t offset = 0;
};

Address parse_address(const RegionDescriptor& d) {
  const std::vector<std::string_view> fields = split_fields(d.address);
  const std::vector<std::string> parts(fields.begin(), fields.end());
  Address out;
  const auto bad = [&](const char* why) {
    fail(str("region ", d.id, " has a malformed CUDA IPC address (", why, ")"));
  };
  if (parts.size() != 5 || parts[0] != "cudaipc")
    bad("expected cudaipc:<pid>:<device>:<handle>:<offset>");
  try {
    out.pid = std::stol(parts[1]);
    out.device = std::stoi(parts[2]);
    out.offset = std::stoull(parts[4]);
  } catch (const std::exception&) {
    bad("a number does not parse");
  }
  std::string handle;
  if (!from_hex(parts[3], handle) || handle.size() != sizeof out.handle) {
    bad("the handle is not hex of the right length");
  }
  std::memcpy(&out.handle, handle.data(), sizeof out.handle);
  return out;
}

class CudaIpcTransport : public Transport {
 public:
  explicit CudaIpcTransport(const CudaIpcTransportOptions& o) : options_(o) {
    int count = 0;
    check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    RELAY_CHECK(o.device >= 0 && o.device < count, "CUDA IPC transport: device ", o.device,
                " does not exist (", count, " devices)");
    check(cudaSetDevice(o.device), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
  }

  ~CudaIpcTransport() override {
    cudaSetDevice(options_.device);
    cudaStreamSynchronize(stream_);
    for (auto& [id, r] : regions_) {
      if (r.opened_base != nullptr) cudaIpcCloseMemHandle(r.opened_base);
    }
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }

  std::string_view name() const override { return "cuda_ipc"; }

  std::string add_local_region(RegionId id, std::byte* base, uint64_t bytes) override {
    check(cudaSetDevice(options_.device), "cudaSetDevice");
    cudaPointerAttributes attr{};
    check(cudaPointerGetAttributes(&attr, base), "cudaPointerGetAttributes");
    RELAY_CHECK(attr.type == cudaMemoryTypeDevice, "CUDA IPC transport: region ", id,
                " is not device memory (register host memory with the UCX transport)");
    // NOTE: an IPC handle names the whole allocation; the offset locates the region in it. The
    // driver call comes through the runtime's entry-point table, so the binary does not link
    // libcuda (it must start on machines without a GPU driver).
    using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    static const GetAddressRange get_address_range = [] {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found{};
      check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                             &found),
            "cudaGetDriverEntryPointByVersion");
      RELAY_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                  "CUDA IPC transport: the driver has no cuMemGetAddressRange");
      return reinterpret_cast<GetAddressRange>(fn);
    }();
    CUdeviceptr alloc_base = 0;
    size_t alloc_size = 0;
    const CUresult r =
        get_address_range(&alloc_base, &alloc_size, reinterpret_cast<CUdeviceptr>(base));
    RELAY_CHECK(r == CUDA_SUCCESS, "CUDA IPC transport: cannot find the allocation of region ", id);
    const uint64_t offset = reinterpret_cast<CUdeviceptr>(base) - alloc_base;
    RELAY_CHECK(offset + bytes <= alloc_size, "CUDA IPC transport: region ", id,
                " runs past its allocation");
    cudaIpcMemHandle_t handle{};
    check(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc_base)), "cudaIpcGetMemHandle");
    std::lock_guard lock(mu_);
    regions_[id] = Region{base, nullptr};
    return str("cudaipc:", getpid(), ":", options_.device, ":", to_hex(&handle, sizeof handle), ":",
               offset);
  }

  void add_remote_region(const RegionDescriptor& d) override {
    const Address a = parse_address(d);
    std::lock_guard lock(mu_);
    if (a.pid == getpid()) {
      // Our own region, exported and imported back: write it directly (a process cannot open its
      // own IPC handle).
      RELAY_CHECK(regions_.count(d.id) == 1 && regions_[d.id].opened_base == nullptr, "region ",
                  d.id, " claims to be this process's, but it is not registered here");
      return;
    }
    check(cudaSetDevice(options_.device), "cudaSetDevice");
    void* mapped = nullptr;
    check(cudaIpcOpenMemHandle(&mapped, a.handle, cudaIpcMemLazyEnablePeerAccess),
          "cudaIpcOpenMemHandle");
    regions_[d.id] = Region{static_cast<std::byte*>(mapped) + a.offset, mapped};
  }

  void remove_region(RegionId id) override {
    std::lock_guard lock(mu_);
    const auto it = regions_.find(id);
    if (it == regions_.end()) return;
    if (it->second.opened_base != nullptr) {
      cudaSetDevice(options_.device);
      cudaStreamSynchronize(stream_);
      cudaIpcCloseMemHandle(it->second.opened_base);
    }
    regions_.erase(it);
  }

  void post(const TransferCopy& c) override {
    std::byte *src = nullptr, *dst = nullptr;
    {
      std::lock_guard lock(mu_);
      src = regions_.at(c.src_region).base;
      dst = regions_.at(c.dst_region).base;
    }
    // The engine's worker thread has no current device of its own.
    check(cudaSetDevice(options_.device), "cudaSetDevice");
    check(cudaMemcpyAsync(dst + c.dst_offset_bytes, src + c.src_offset_bytes, c.bytes,
                          cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpyAsync");
  }

  void wait_posted() override {
    check(cudaSetDevice(options_.device), "cudaSetDevice");
    check(cudaEventRecord(done_, stream_), "cudaEventRecord");
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    for (;;) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, "copy");
      if (std::chrono::steady_clock::now() > deadline) {
        fail(
            str("CUDA IPC transport: copies did not complete within ", options_.timeout_ms, " ms"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  struct Region {
    std::byte* base = nullptr;    // where its byte 0 is in this process
    void* opened_base = nullptr;  // the mapped allocation of a peer's region (to close)
  };

  CudaIpcTransportOptions options_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::mutex mu_;
  std::unordered_map<RegionId, Region> regions_;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_ipc_transport(const CudaIpcTransportOptions& options) {
  return std::make_unique<CudaIpcTransport>(options);
}

}  // namespace relay
