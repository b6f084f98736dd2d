// Hugging Face block-FP8 checkpoints <-> the kernel layout of one MoE layer
// (docs/numerics.md §2, §7, §9): the table saying where each checkpoint tensor lands,
// load_moe_layer, and writers for synthetic checkpoints used by tests and
// benchmarks. The files themselves (safetensors, the index, config.json) are the
// io layer's (io/safetensors.h, io/checkpoint.h); this is where they meet the layout.
//
// Tensor names of MoE layer L, relative to ModelDesc::layer_prefix(L):
//   experts.{e}.{gate,up,down}_proj.weight            F8_E4M3 [I, H] / [H, I]
//   experts.{e}.{gate,up,down}_proj.weight_scale_inv  F32 [ceil(rows/128), ceil(cols/128)]
//   shared_experts.{gate,up,down}_proj.weight(_scale_inv)  the same with I_s = S*I
//   gate.weight                                       BF16 or F32 [E, H]
//   gate.e_score_correction_bias                      F32 [E]
// gate_proj fills rows [0, I) of the expert's w13 and up_proj rows [I, 2I);
// their scales fill the gate block-rows, then the up block-rows.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/io/checkpoint.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/model/config.h"
#include "megamoe/weights/host_weights.h"
#include "megamoe/weights/layout.h"

namespace megamoe {

// Where one checkpoint tensor lives in the kernel layout. The whole mapping of
// a layer is a list of these, shared by the loader, the writers and the
// WeightStore, so the directions cannot drift apart.
struct TensorSlot {
  std::string name;                           // full checkpoint name (prefix included)
  Region MoeWeightLayout::*region = nullptr;  // destination region of the layout
  size_t offset = 0;                          // byte offset inside that region
  io::Dtype dtype = io::Dtype::kU8;
  std::vector<int64_t> shape;

  size_t bytes() const;
  // Absolute byte offset into a buffer laid out by `l`.
  size_t at(const MoeWeightLayout& l) const { return (l.*region).offset + offset; }
};

// Every tensor of one MoE layer with shape `s` (including s.router_dtype and
// s.correction_bias), named under `prefix`. Offsets are relative to each
// region, so the table holds for any buffer laid out by MoeWeightLayout::compute(s).
std::vector<TensorSlot> moe_layer_slots(const MoeShape& s, std::string_view prefix);
// Only the routed experts of `experts` (named by their index in the layer, placed from
// the region's start): the table of a layout MoeWeightLayout::compute(s, experts).
std::vector<TensorSlot> moe_layer_slots(const MoeShape& s, std::string_view prefix, ExpertRange experts);

// "expected F8_E4M3 [256, 128], found F8_E4M3 [128, 256]" when a tensor of `dtype` and
// `shape` cannot fill slot `s`; nullopt when it can.
std::optional<std::string> slot_mismatch(const TensorSlot& s, io::Dtype dtype,
                                         std::span<const int64_t> shape);

// The tensors among `names` in the expert namespaces of the layer under `prefix`
// (experts., shared_experts.) that `slots` do not name, one message each: the file and
// the config disagree (e.g. on E or S), and loading anyway would drop weights.
std::vector<std::string> unexpected_tensors(const std::vector<TensorSlot>& slots, std::string_view prefix,
                                            const MoeShape& s, const std::vector<std::string>& names);

// The first value of slot `s`'s tensor (`data`: s.bytes() bytes of s.dtype) that no
// checkpoint may hold, described as "holds V at [r, c] (the rule)": a block scale failing
// num::is_valid_block_scale, a router weight or correction bias that is not finite. E4M3
// weights are not scanned (99.9 % of the bytes). nullopt when every value is good.
// load_moe_layer and the WeightStore refuse such a tensor.
std::optional<std::string> find_corrupt_value(const TensorSlot& s, const void* data);

// Loads MoE layer `layer` into the kernel layout. The router dtype is the one
// gate.weight has in the file (BF16 or F32), whatever the config claims; the
// returned weights' shape records it. Every tensor's dtype and shape is checked
// against the description. Throws io::NotFoundError listing every missing tensor
// by name, io::FormatError for wrong dtype/shape (file, tensor, expected vs found)
// or for tensors under the layer's experts./shared_experts. prefixes that the
// description does not account for (e.g. more experts in the file than in
// the config) or holding a corrupt value (find_corrupt_value), std::invalid_argument if
// `layer` is not a MoE layer.
HostMoeWeights load_moe_layer(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer);

// The HF-layout tensors of one layer as zero-copy views into `w` (the inverse
// of load_moe_layer); valid while `w` lives. Tests may drop or alter entries
// before writing them.
std::vector<io::TensorToWrite> layer_tensors(const HostMoeWeights& w, std::string_view prefix);
// Writes layer_tensors(w, prefix) as one safetensors file.
void write_layer_tensors(const std::filesystem::path& file, const HostMoeWeights& w, std::string_view prefix);

// A complete synthetic HF-layout block-FP8 checkpoint in `dir` (created if
// needed): config.json in the family's key style, the index, and shards (one
// for the non-MoE tensors, two per MoE layer: experts [0, E/2) with the
// router, experts [E/2, E) with the shared expert). The model keeps `base`'s
// family and leading dense layers and has `num_moe_layers` MoE layers after
// them; `shape` replaces base.shape (e.g. a reduced test size). MoE layer L
// holds make_random_weights(shape, seed + L, pow2_scales); pow2_scales also
// sets scale_fmt "ue8m0". A few small dummy non-MoE tensors (embeddings, norms,
// attention, dense MLPs) are written too, so loaders must ignore what they do
// not need. Returns the description the config encodes.
ModelDesc write_synthetic_checkpoint(const std::filesystem::path& dir, const ModelDesc& base,
                                     int num_moe_layers, uint64_t seed, bool pow2_scales,
                                     std::optional<MoeShape> shape = std::nullopt);
ModelDesc write_synthetic_checkpoint(const std::filesystem::path& dir, const Preset& base, int num_moe_layers,
                                     uint64_t seed, bool pow2_scales,
                                     std::optional<MoeShape> shape = std::nullopt);

// The io:: spellings of the names above, deprecated: the io layer sits below the
// weights layout and cannot declare them itself. (A using-declaration of a function
// cannot carry [[deprecated]]; the type alias does.)
namespace io {
using TensorSlot [[deprecated("use megamoe::TensorSlot (megamoe/weights/checkpoint_layout.h)")]] =
    megamoe::TensorSlot;
using megamoe::find_corrupt_value;
using megamoe::layer_tensors;
using megamoe::load_moe_layer;
using megamoe::moe_layer_slots;
using megamoe::slot_mismatch;
using megamoe::unexpected_tensors;
using megamoe::write_layer_tensors;
using megamoe::write_synthetic_checkpoint;
}  // namespace io

}  // namespace megamoe
