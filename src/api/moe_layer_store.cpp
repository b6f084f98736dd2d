// CudaMoeLayer borrowing a WeightStore's layer: here, in C++20, because store.h is
// (moe_layer.cu is CUDA C++17). Only with the CUDA backend, like the rest of the class.
#include "megamoe/api/moe_layer.h"

#if defined(MEGAMOE_HAVE_CUDA)

#include <fmt/format.h>

#include <stdexcept>

#include "megamoe/api/ep_layer.h"
#include "megamoe/weights/store.h"

namespace megamoe::api {

namespace {

// The shape of a store's layer that a layer object can borrow (moe_layer.h says when).
const MoeShape& borrowable_layer(const WeightStore& store, int layer) {
  // (a layer the store does not hold: store.shape and store.base throw, naming the held ones)
  if (store.memory() != StoreMemory::kDevice)
    throw std::invalid_argument(fmt::format(
        "CudaMoeLayer: the WeightStore holds layer {} in host memory (make it with StoreMemory::kDevice)",
        layer));
  if (!store.ready(layer))
    throw std::invalid_argument(
        fmt::format("CudaMoeLayer: layer {} of the WeightStore is not loaded (ready() is false)", layer));
  if (!store.layout(layer).whole(store.shape(layer)))
    throw std::invalid_argument(
        fmt::format("CudaMoeLayer: the WeightStore holds {} of layer {} (an expert-parallel rank's part: "
                    "CudaEpMoeLayer takes it)",
                    store.layout(layer).experts_text(store.shape(layer)), layer));
  return store.shape(layer);
}

}  // namespace

CudaMoeLayer::CudaMoeLayer(const WeightStore& store, int layer, const MoeLayerOptions& opt)
    : CudaMoeLayer(borrowable_layer(store, layer), store.base(layer), opt) {}

CudaEpMoeLayer::CudaEpMoeLayer(const WeightStore& store, int layer, const EpLayerOptions& opt)
    : CudaEpMoeLayer(std::vector<const WeightStore*>{&store}, layer, opt) {}

CudaEpMoeLayer::CudaEpMoeLayer(const std::vector<const WeightStore*>& stores, int layer,
                               const EpLayerOptions& opt)
    : CudaEpMoeLayer(
          [&] {
            std::vector<WeightSource> src;
            for (const WeightStore* st : stores) {
              if (!st) throw std::invalid_argument("CudaEpMoeLayer: a null WeightStore");
              if (!st->ready(layer))  // (a layer the store does not hold: throws, naming the held ones)
                throw std::invalid_argument(
                    fmt::format("CudaEpMoeLayer: layer {} of WeightStore {} is not loaded (ready() is false)",
                                layer, src.size()));
              src.push_back({st->shape(layer), st->layout(layer), st->base(layer),
                             st->memory() == StoreMemory::kDevice});
            }
            return src;
          }(),
          opt) {}

}  // namespace megamoe::api

#endif  // MEGAMOE_HAVE_CUDA
