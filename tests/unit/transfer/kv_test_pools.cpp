// Running a copy plan through the in-process transport (see kv_test_pools.h).
#include "kv_test_pools.h"

#include "transfer/in_process_transport.h"
#include "transfer/transfer_engine.h"

namespace relay::test {

std::string run_copies(const std::vector<PoolMemory*>& pools, std::span<const KvCopy> copies) {
  TransferEngine engine(make_in_process_transport());
  for (PoolMemory* pool : pools) {
    for (auto& [id, mem] : pool->regions) engine.register_region(id, mem.data(), mem.size());
  }
  TransferRequest request;
  request.request_id = 1;
  request.copies = transfer_copies(copies);
  const TransferResult result = engine.submit(std::move(request)).get();
  if (result.status != TransferStatus::Ok) return result.reason;
  return std::string(transfer_status_name(result.status));
}

}  // namespace relay::test
