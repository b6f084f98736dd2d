// The files of a Hugging Face checkpoint folder besides the shards: writers for
// config.json and model.safetensors.index.json (the folder itself is read by
// io::Checkpoint, safetensors.h). Where a checkpoint's tensors land in the kernel
// layout (the slot table, load_moe_layer, the synthetic checkpoint writer) is the
// weights layer's: megamoe/weights/checkpoint_layout.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"

namespace megamoe::io {

// Writes `dir`/config.json (config_json(d)).
void write_config(const std::filesystem::path& dir, const ModelDesc& d);
// Writes `dir`/model.safetensors.index.json for a tensor name -> shard file map.
void write_index(const std::filesystem::path& dir, const std::map<std::string, std::string>& weight_map,
                 uint64_t total_size = 0);

}  // namespace megamoe::io

// Deprecated for one release: the slot table, load_moe_layer and the checkpoint writers moved
// to megamoe/weights/checkpoint_layout.h; a program that reached them through this header
// keeps compiling. The library itself is built with MEGAMOE_IO_ONLY, so io includes nothing
// from the weights layer above it.
#ifndef MEGAMOE_IO_ONLY
#include "megamoe/weights/checkpoint_layout.h"
#endif
