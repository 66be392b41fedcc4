// The model builders, one per supported Hugging Face architecture (one .cpp each); registry.cpp
// lists them. Adding an architecture adds a file and one line there.
#pragma once

#include <memory>

#include "model/config.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace relay {

// qwen3.cpp
std::unique_ptr<Model> build_qwen3(const ModelConfig& config, const Checkpoint& ckpt,
                                   const ShardSpec& shard);
// qwen3_moe.cpp
std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& config, const Checkpoint& ckpt,
                                       const ShardSpec& shard);
// qwen3_5.cpp: Qwen3.5 and Qwen3.5-MoE, text-only or vision-language checkpoints
std::unique_ptr<Model> build_qwen3_5(const ModelConfig& config, const Checkpoint& ckpt,
                                     const ShardSpec& shard);
// qwen3_next.cpp
std::unique_ptr<Model> build_qwen3_next(const ModelConfig& config, const Checkpoint& ckpt,
                                        const ShardSpec& shard);

}  // namespace relay
