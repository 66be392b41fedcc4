// The model builders, one per supported Hugging Face architecture (one .cpp each); registry.cpp
// lists them. Adding an architecture adds a file and one line there.
#pragma once

#include <memory>

#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace relay {

std::unique_ptr<Model> build_qwen3(const ModelConfig& config, const Checkpoint& ckpt);      // qwen3.cpp
std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& config, const Checkpoint& ckpt);  // qwen3_moe.cpp

}  // namespace relay
