// The in-process transport: copies are memcpy between regions of one address space.
//
// It serves a single-process deployment (prefill and decode ranks as threads of one server, CPU
// backend or host memory) and every test of the engine. A region's address is "<pid>:0x<hex
// pointer>"; importing a descriptor from another process is refused, since its pointer means
// nothing here. Copies land before post() returns, so wait_posted() has nothing to wait for.
#pragma once

#include <memory>

#include "transfer/transfer_engine.h"

namespace relay {

std::unique_ptr<Transport> make_in_process_transport();

}  // namespace relay
