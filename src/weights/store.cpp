// WeightStore (see store.h): allocation, name lookup through the
// moe_layer_slots table, pair bookkeeping, the MXFP8 derived copy, and the
// streaming checkpoint loader.
#include "megamoe/weights/store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <shared_mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "megamoe/weights/device_memory.h"

namespace megamoe {

namespace {

constexpr size_t kAlign = 256;
constexpr std::string_view kScaleSuffix = "_scale_inv";
// Missing tensors listed per incomplete layer: a wrong E can make thousands.
constexpr size_t kMaxMissingListed = 32;

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

// Per slot of the table: its pair partner and, for a weight, where its MXFP8
// copy goes. Derived from the slot table, never from names of our own.
struct SlotInfo {
  int partner = -1;  // the other half of a (weight, scale) pair; -1 for router and bias
  bool is_scale = false;
  Region Mxfp8Layout::*mx_q = nullptr;  // weights only
  Region Mxfp8Layout::*mx_sf = nullptr;
};

struct Layer {
  int index = 0;  // decoder layer
  std::string prefix;
  MoeShape shape;
  MoeWeightLayout layout;
  Mxfp8Layout mx;
  size_t mx_offset = 0;  // byte offset of the MXFP8 copy inside the allocation
  size_t alloc_bytes = 0;
  uint8_t* base = nullptr;
  size_t map_bytes = 0;  // host memory: length of the anonymous mapping
  std::vector<TensorSlot> slots;
  std::vector<SlotInfo> info;
  std::vector<num::RequantReport> pair_reports;  // indexed by the weight's slot

  // Session state.
  std::vector<uint8_t> arrived;
  size_t arrived_count = 0;
  bool touched = false;
  bool ready = false;
  // Whole at least once: an incomplete layer was withdrawn by a session, not never loaded.
  bool was_ready = false;
  // Weight slots whose pair a direct session closed on half written (a new weight with
  // the old scale, or the reverse): the layer is not ready until a session brings both
  // halves of each (or the whole layer). Kept across sessions.
  std::vector<size_t> mixed;
  bool usable() const { return ready && mixed.empty(); }
};

void mx_regions_for(Region MoeWeightLayout::*r, SlotInfo& si) {
  if (r == &MoeWeightLayout::w13) si.mx_q = &Mxfp8Layout::w13, si.mx_sf = &Mxfp8Layout::w13_sf;
  if (r == &MoeWeightLayout::w2) si.mx_q = &Mxfp8Layout::w2, si.mx_sf = &Mxfp8Layout::w2_sf;
  if (r == &MoeWeightLayout::shared_w13)
    si.mx_q = &Mxfp8Layout::shared_w13, si.mx_sf = &Mxfp8Layout::shared_w13_sf;
  if (r == &MoeWeightLayout::shared_w2)
    si.mx_q = &Mxfp8Layout::shared_w2, si.mx_sf = &Mxfp8Layout::shared_w2_sf;
}

std::vector<SlotInfo> slot_infos(const std::vector<TensorSlot>& slots) {
  std::unordered_map<std::string_view, int> by_name;
  for (size_t i = 0; i < slots.size(); ++i) by_name[slots[i].name] = int(i);
  std::vector<SlotInfo> info(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    std::string_view n = slots[i].name;
    if (!n.ends_with(kScaleSuffix)) continue;
    auto w = by_name.find(n.substr(0, n.size() - kScaleSuffix.size()));
    if (w == by_name.end()) continue;
    info[i].partner = w->second, info[i].is_scale = true;
    info[size_t(w->second)].partner = int(i);
    mx_regions_for(slots[size_t(w->second)].region, info[size_t(w->second)]);
  }
  return info;
}

}  // namespace

// ---------------------------------------------------------------- names

std::string_view to_string(StoreMemory m) { return m == StoreMemory::kHost ? "host" : "device"; }
std::string_view to_string(KernelFormat f) {
  return f == KernelFormat::kBlockFp8Hopper ? "block-fp8-hopper" : "mxfp8-blackwell";
}
std::string_view to_string(ReloadMode m) { return m == ReloadMode::kLayerwise ? "layerwise" : "direct"; }

ReloadMode parse_reload_mode(std::string_view s) {
  if (s == "layerwise") return ReloadMode::kLayerwise;
  if (s == "direct") return ReloadMode::kDirect;
  throw std::invalid_argument(fmt::format("unknown reload mode '{}' (layerwise, direct)", s));
}

Mxfp8Layout Mxfp8Layout::compute(const MoeShape& s) { return compute(s, s.experts); }

Mxfp8Layout Mxfp8Layout::compute(const MoeShape& s, int experts) {
  s.validate();
  if (s.hidden % num::kMxGroup != 0 || s.inter % num::kMxGroup != 0)
    throw std::invalid_argument(fmt::format("MXFP8 kernel format: H = {} and I = {} must be multiples of {}",
                                            s.hidden, s.inter, num::kMxGroup));
  Mxfp8Layout l;
  RegionPlanner plan(kAlign);
  auto place = [&](Region& r, size_t bytes) { plan.place(r, bytes); };
  const size_t H = size_t(s.hidden), I = size_t(s.inter), E = size_t(experts), Is = size_t(s.shared_inter());
  const size_t g = num::kMxGroup;
  place(l.w13, E * 2 * I * H);
  place(l.w13_sf, E * 2 * I * H / g);
  place(l.w2, E * H * I);
  place(l.w2_sf, E * H * I / g);
  if (s.has_shared()) {
    place(l.shared_w13, 2 * Is * H);
    place(l.shared_w13_sf, 2 * Is * H / g);
    place(l.shared_w2, H * Is);
    place(l.shared_w2_sf, H * Is / g);
  }
  l.total_bytes = plan.total();
  return l;
}

uint64_t hash_bytes(const void* data, size_t bytes) {
  // Word-at-a-time multiply-xorshift; the length is mixed in so that trailing
  // zero bytes change the hash.
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = 0x9e3779b97f4a7c15ull ^ bytes;
  auto mix = [&](uint64_t w) {
    h ^= w + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
  };
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    mix(w);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, bytes - i);
  mix(tail);
  return h;
}

// ---------------------------------------------------------------- Impl

struct WeightStore::Impl {
  WeightStoreOptions opt;
  std::vector<int> layer_ids;
  std::vector<Layer> layers;
  std::unordered_map<int, size_t> by_layer;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>> by_name;
  // The tensors of the held layers' routed experts outside WeightStoreOptions::experts
  // (other expert-parallel ranks'): not ours, like an attention weight.
  std::unordered_set<std::string, StringHash, std::equal_to<>> not_held;
  mutable std::mutex mu;
  // Held shared by host readers (read_lock), exclusively by every call that writes bytes or
  // readiness; always taken before `mu`.
  mutable std::shared_mutex bytes_mu;

  bool session = false;
  ReloadMode mode = ReloadMode::kLayerwise;
  FinishReport report;

  ~Impl() {
    for (Layer& l : layers) {
      if (!l.base) continue;
      if (opt.memory == StoreMemory::kDevice)
        dev::device_free(l.base);
      else
        ::munmap(l.base, l.map_bytes);
    }
  }

  bool device() const { return opt.memory == StoreMemory::kDevice; }
  std::optional<std::pair<uint32_t, uint32_t>> validate(std::string_view name, io::Dtype dtype,
                                                        std::span<const int64_t> shape, const void* data,
                                                        size_t bytes, bool& from_device) const;
  bool mxfp8() const { return opt.kernel_format == KernelFormat::kMxfp8Blackwell; }
  // Every writer's locks, in the one order: the readers' hold (bytes_mu), then mu.
  struct WriteHold {
    std::unique_lock<std::shared_mutex> bytes;
    std::unique_lock<std::mutex> meta;
  };
  WriteHold write_hold() { return {std::unique_lock(bytes_mu), std::unique_lock(mu)}; }
  // A validated tensor written into its slot (the write hold taken).
  void write_slot(std::pair<uint32_t, uint32_t> target, const void* data, size_t bytes, bool from_device);

  void init(const ModelDesc& desc, const std::vector<MoeShape>& shapes) {
    layers.resize(layer_ids.size());
    for (size_t i = 0; i < layer_ids.size(); ++i) {
      Layer& l = layers[i];
      l.index = layer_ids[i];
      l.prefix = desc.layer_prefix(l.index);
      l.shape = shapes[i];
      const bool all = opt.experts.first == 0 && opt.experts.count == 0;  // (the default)
      const ExpertRange held = all ? ExpertRange{0, l.shape.experts} : opt.experts;
      try {
        l.layout = MoeWeightLayout::compute(l.shape, held);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(fmt::format("WeightStore: layer {}: {}", l.index, e.what()));
      }
      l.mx_offset = round_up(l.layout.total_bytes, kAlign);
      if (mxfp8()) l.mx = Mxfp8Layout::compute(l.shape, held.count);  // the held experts only
      l.alloc_bytes = l.mx_offset + l.mx.total_bytes;
      l.slots = moe_layer_slots(l.shape, l.prefix, held);
      l.info = slot_infos(l.slots);
      l.pair_reports.assign(l.slots.size(), {});
      l.arrived.assign(l.slots.size(), 0);
      by_layer[l.index] = i;
      for (size_t s = 0; s < l.slots.size(); ++s)
        by_name.emplace(l.slots[s].name, std::pair{uint32_t(i), uint32_t(s)});
      // (the experts before the held ones and after them: one slot table each)
      for (const ExpertRange other :
           {ExpertRange{0, held.first}, ExpertRange{held.end(), l.shape.experts - held.end()}})
        if (other.count > 0)
          for (const TensorSlot& s : moe_layer_slots(l.shape, l.prefix, other))
            if (s.region == &MoeWeightLayout::w13 || s.region == &MoeWeightLayout::w13_scale ||
                s.region == &MoeWeightLayout::w2 || s.region == &MoeWeightLayout::w2_scale)
              not_held.insert(s.name);
    }
    // Allocate (and zero: alignment gaps stay zero forever, so two loads of
    // the same checkpoint are byte-identical over the whole allocation, and
    // host pages are faulted in now rather than during a timed load).
    for (Layer& l : layers) {
      if (device()) {
        l.base = static_cast<uint8_t*>(dev::device_alloc(l.alloc_bytes));
        dev::device_memset(l.base, 0, l.alloc_bytes);
      } else {
        // An anonymous mapping, with transparent huge pages where the kernel
        // allows them: 2 MB pages cut the first-touch faults of a multi-GB
        // layer 512-fold, and munmap returns the memory to the system.
        l.map_bytes = round_up(l.alloc_bytes, size_t(2) << 20);
        void* p = ::mmap(nullptr, l.map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        ::madvise(p, l.map_bytes, MADV_HUGEPAGE);  // advisory: fine if THP is off
        l.base = static_cast<uint8_t*>(p);
        std::memset(l.base, 0, l.alloc_bytes);
      }
    }
  }

  Layer& layer(int index) {
    auto it = by_layer.find(index);
    if (it == by_layer.end())
      throw std::invalid_argument(
          fmt::format("WeightStore: layer {} is not held (held: {})", index, fmt::join(layer_ids, ",")));
    return layers[it->second];
  }

  // The slot `name` lands in; nullopt for a name outside every held layer.
  std::optional<std::pair<uint32_t, uint32_t>> resolve(std::string_view name) const {
    auto it = by_name.find(name);
    if (it != by_name.end()) return it->second;
    if (not_held.find(name) != not_held.end()) return std::nullopt;
    // Inside a held layer's expert namespaces but not in the table: the file
    // and the description disagree (e.g. on E); dropping it would be silent.
    for (const Layer& l : layers) {
      if (!name.starts_with(l.prefix)) continue;
      const std::string_view rest = name.substr(l.prefix.size());
      if (rest.starts_with("experts.") || rest.starts_with("shared_experts."))
        throw io::FormatError(
            fmt::format("layer {}: unexpected tensor '{}' (layout: E = {}, shared experts = {})", l.index,
                        name, l.shape.experts, l.shape.shared_experts));
    }
    return std::nullopt;
  }

  void check(const Layer& l, const TensorSlot& s, std::string_view name, io::Dtype dtype,
             std::span<const int64_t> shape, size_t bytes, bool have_data) const {
    if (auto wrong = slot_mismatch(s, dtype, shape))
      throw io::FormatError(fmt::format("layer {}: tensor '{}': {}{}", l.index, name, *wrong,
                                        mode == ReloadMode::kDirect
                                            ? " (direct mode: the live layout cannot be relocated)"
                                            : " (the layout the store allocated from the config; "
                                              "it is never relocated)"));
    if (bytes != s.bytes())
      throw io::FormatError(fmt::format("layer {}: tensor '{}': {} {} is {} bytes, the update brings {}",
                                        l.index, name, io::to_string(s.dtype), io::format_shape(s.shape),
                                        s.bytes(), bytes));
    if (!have_data && bytes)
      throw io::FormatError(fmt::format("layer {}: tensor '{}': null data", l.index, name));
  }

  // The values of a block scale, router or bias tensor (find_corrupt_value; weights are
  // E4M3 codes and are not scanned: 99.9 % of the bytes). A corrupt value would turn tokens'
  // outputs into NaN without a word, so the tensor is refused before a byte is written (the
  // slot keeps its old bytes). Costs one read of ~0.1 % of a layer's bytes (GLM-5: 2.4 MB of
  // scales and 6.3 MB of router in 9.7 GB).
  static bool has_checked_values(const Layer& l, size_t slot) {
    return l.slots[slot].dtype != io::Dtype::kF8_E4M3;  // (what find_corrupt_value scans)
  }
  void check_values(const Layer& l, size_t slot, std::string_view name, const void* data) const {
    if (auto bad = find_corrupt_value(l.slots[slot], data))
      throw io::FormatError(
          fmt::format("layer {}: tensor '{}' {}: the checkpoint is corrupt", l.index, name, *bad));
  }

  // src_on_device: a device store's update from device memory (update()).
  void write(uint8_t* dst, const void* src, size_t n, bool src_on_device = false) const {
    if (src_on_device)
      dev::copy_device_to_device(dst, src, n);
    else if (device())
      dev::copy_to_device(dst, src, n);
    else
      std::memcpy(dst, src, n);
  }

  // ---- MXFP8 derived copy ----
  num::RequantReport requant_pair(Layer& l, size_t w) {
    const TensorSlot& ws = l.slots[w];
    const TensorSlot& ss = l.slots[size_t(l.info[w].partner)];
    const int rows = int(ws.shape[0]), cols = int(ws.shape[1]);
    const size_t n = ws.bytes(), nsf = n / num::kMxGroup;
    uint8_t* q_dst = l.base + l.mx_offset + (l.mx.*(l.info[w].mx_q)).offset + ws.offset;
    uint8_t* sf_dst = l.base + l.mx_offset + (l.mx.*(l.info[w].mx_sf)).offset + ws.offset / num::kMxGroup;
    const uint8_t* q_src = l.base + ws.at(l.layout);
    const uint8_t* s_src = l.base + ss.at(l.layout);
    num::RequantReport r;
    try {
      if (!device()) {
        r = num::requant_block_to_mxfp8(q_src, reinterpret_cast<const float*>(s_src), rows, cols, q_dst,
                                        sf_dst);
      } else {
        // Device memory: requantize on the host from a copy of what landed
        // (the update's source may be gone by the time the pair completes).
        std::vector<uint8_t> q(n), sc(ss.bytes()), qo(n), so(nsf);
        dev::copy_to_host(q.data(), q_src, n);
        dev::copy_to_host(sc.data(), s_src, sc.size());
        r = num::requant_block_to_mxfp8(q.data(), reinterpret_cast<const float*>(sc.data()), rows, cols,
                                        qo.data(), so.data());
        dev::copy_to_device(q_dst, qo.data(), n);
        dev::copy_to_device(sf_dst, so.data(), nsf);
      }
    } catch (const std::exception& e) {
      throw io::FormatError(
          fmt::format("layer {}: MXFP8 requantization of '{}': {}", l.index, ws.name, e.what()));
    }
    l.pair_reports[w] = r;
    return r;
  }

  // Requantizes every pair of the layer (layerwise processing), spread over
  // the cores: pairs write disjoint ranges.
  num::RequantReport requant_layer(Layer& l) {
    std::vector<size_t> pairs;
    for (size_t i = 0; i < l.slots.size(); ++i)
      if (l.info[i].mx_q) pairs.push_back(i);
    const size_t nt =
        std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), pairs.size()));
    std::atomic<size_t> next{0};
    std::mutex err_mu;
    std::string err;
    auto work = [&] {
      for (size_t k; (k = next.fetch_add(1)) < pairs.size();) {
        try {
          requant_pair(l, pairs[k]);
        } catch (const std::exception& e) {
          std::lock_guard g(err_mu);
          if (err.empty()) err = e.what();
        }
      }
    };
    std::vector<std::thread> ts;
    for (size_t t = 1; t < nt; ++t) ts.emplace_back(work);
    work();
    for (auto& t : ts) t.join();
    if (!err.empty()) throw io::FormatError(err);
    num::RequantReport total;
    for (size_t p : pairs) total += l.pair_reports[p];
    return total;
  }

  void note_requant(const Layer& l, std::string_view what, const num::RequantReport& r) {
    report.mxfp8 += r;
    if (!r.all_pow2) num::warn_non_pow2_once(fmt::format("layer {} ({})", l.index, what), r.rel_l2);
  }

  // Bookkeeping after a tensor landed: pairs, readiness, derived tensors.
  void arrived(Layer& l, size_t s) {
    if (!l.arrived[s]) l.arrived[s] = 1, ++l.arrived_count;
    const bool complete = l.arrived_count == l.slots.size();
    if (complete) {
      l.mixed.clear();
    } else if (const int partner = l.info[s].partner; partner >= 0 && l.arrived[size_t(partner)]) {
      const size_t w = l.info[s].is_scale ? size_t(partner) : s;
      l.mixed.erase(std::remove(l.mixed.begin(), l.mixed.end(), w), l.mixed.end());
    }
    if (mode == ReloadMode::kLayerwise) {
      if (complete) {
        if (mxfp8()) note_requant(l, "MXFP8 requantization", requant_layer(l));
        l.ready = l.was_ready = true;
        ++report.layers_processed;
      }
      return;
    }
    // Direct: the derived copy of a pair follows as soon as both halves are in.
    const int partner = l.info[s].partner;
    if (mxfp8() && partner >= 0 && l.arrived[size_t(partner)]) {
      const size_t w = l.info[s].is_scale ? size_t(partner) : s;
      note_requant(l, l.slots[w].name, requant_pair(l, w));
    }
    if (complete) {
      l.ready = l.was_ready = true;
      ++report.layers_processed;
    }
  }

  // A session closes (finish, or a load that threw): in direct mode every pair that got
  // one half leaves its layer mixed (the halves no longer belong together).
  void close_session() {
    session = false;
    if (mode != ReloadMode::kDirect) return;  // (layerwise: a touched layer stays not ready)
    for (Layer& l : layers)
      for (size_t s : half_pairs(l))
        if (std::find(l.mixed.begin(), l.mixed.end(), s) == l.mixed.end()) l.mixed.push_back(s);
  }

  // The weight slots of the session's pairs of which one half arrived.
  static std::vector<size_t> half_pairs(const Layer& l) {
    std::vector<size_t> h;
    for (size_t s = 0; s < l.slots.size(); ++s) {
      const int p = l.info[s].partner;
      if (p >= 0 && !l.info[s].is_scale && l.arrived[s] != l.arrived[size_t(p)]) h.push_back(s);
    }
    return h;
  }

  // The first update of a layer in a layerwise session withdraws readiness:
  // its bytes are in flux until the last tensor arrives.
  void touch(Layer& l) {
    if (l.touched) return;
    l.touched = true;
    if (mode == ReloadMode::kLayerwise) l.ready = false;
  }
};

// ---------------------------------------------------------------- WeightStore

WeightStore::WeightStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
WeightStore::~WeightStore() = default;
WeightStore::WeightStore(WeightStore&&) noexcept = default;
WeightStore& WeightStore::operator=(WeightStore&&) noexcept = default;

namespace {

std::vector<int> held_layers(const ModelDesc& desc, const WeightStoreOptions& opt) {
  std::vector<int> ids = opt.layers.empty() ? desc.moe_layers : opt.layers;
  std::sort(ids.begin(), ids.end());
  if (std::adjacent_find(ids.begin(), ids.end()) != ids.end())
    throw std::invalid_argument("WeightStore: a layer is listed twice");
  for (int l : ids) desc.require_moe_layer(l, "WeightStore: layer");
  if (ids.empty()) throw std::invalid_argument("WeightStore: the model has no MoE layer");
  return ids;
}

}  // namespace

WeightStore::WeightStore(const ModelDesc& desc, const WeightStoreOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  impl_->opt = opt;
  impl_->layer_ids = held_layers(desc, opt);
  impl_->init(desc, std::vector<MoeShape>(impl_->layer_ids.size(), desc.shape));
}

WeightStore WeightStore::for_checkpoint(const io::Checkpoint& ckpt, const ModelDesc& desc,
                                        const WeightStoreOptions& opt) {
  auto impl = std::make_unique<Impl>();
  impl->opt = opt;
  impl->layer_ids = held_layers(desc, opt);
  std::vector<MoeShape> shapes;
  for (int l : impl->layer_ids) {
    MoeShape s = desc.shape;
    // The file decides how the router is stored (configs do not always say).
    if (auto g = ckpt.find(desc.layer_prefix(l) + "gate.weight")) {
      if (g->dtype == io::Dtype::kBF16) s.router_dtype = RouterDtype::kBF16;
      if (g->dtype == io::Dtype::kF32) s.router_dtype = RouterDtype::kF32;
    }
    shapes.push_back(s);
  }
  impl->init(desc, shapes);
  return WeightStore(std::move(impl));
}

void WeightStore::begin(ReloadMode mode) {
  const auto hold = impl_->write_hold();
  if (impl_->session) throw std::logic_error("WeightStore::begin: a load session is already open");
  impl_->session = true;
  impl_->mode = mode;
  impl_->report = {};
  for (Layer& l : impl_->layers) {
    std::fill(l.arrived.begin(), l.arrived.end(), 0);
    l.arrived_count = 0;
    l.touched = false;
  }
}

bool WeightStore::in_session() const {
  std::lock_guard g(impl_->mu);
  return impl_->session;
}

// Everything update() refuses, checked without writing: the name, dtype, shape and size
// against the layout and the values of a scale, router or bias tensor. `staged` receives a
// device tensor's checked values (read back once); returns the slot, nullopt for a name
// the store does not hold.
std::optional<std::pair<uint32_t, uint32_t>> WeightStore::Impl::validate(std::string_view name,
                                                                         io::Dtype dtype,
                                                                         std::span<const int64_t> shape,
                                                                         const void* data, size_t bytes,
                                                                         bool& from_device) const {
  if (!session)
    throw std::logic_error(fmt::format("WeightStore::update('{}'): no session (call begin())", name));
  const auto target = resolve(name);
  if (!target) return std::nullopt;
  const Layer& l = layers[target->first];
  check(l, l.slots[target->second], name, dtype, shape, bytes, data != nullptr);
  // A device store also takes device memory (a trainer's tensors): copied device to
  // device; the few values check_values reads come back to the host first.
  const dev::PointerInfo mem = dev::pointer_info(data);
  from_device = device() && (mem.device || mem.managed);
  if (mem.device && !device())
    throw std::invalid_argument(fmt::format(
        "WeightStore::update('{}'): the data is in device memory, but this store is in host memory "
        "(copy it to the host, or use a device store)",
        name));
  if (from_device && has_checked_values(l, target->second)) {
    std::vector<uint8_t> staged(bytes);
    dev::copy_to_host(staged.data(), data, bytes);
    check_values(l, target->second, name, staged.data());
  } else {
    check_values(l, target->second, name, data);
  }
  return target;
}

bool WeightStore::validate(std::string_view name, io::Dtype dtype, std::span<const int64_t> shape,
                           const void* data, size_t bytes) const {
  std::lock_guard g(impl_->mu);
  bool from_device = false;
  return impl_->validate(name, dtype, shape, data, bytes, from_device).has_value();
}

void WeightStore::Impl::write_slot(std::pair<uint32_t, uint32_t> target, const void* data, size_t bytes,
                                   bool from_device) {
  Layer& l = layers[target.first];
  const TensorSlot& s = l.slots[target.second];
  touch(l);
  write(l.base + s.at(l.layout), data, bytes, from_device);
  ++report.tensors, report.bytes += bytes;
  arrived(l, target.second);
}

bool WeightStore::update(std::string_view name, io::Dtype dtype, std::span<const int64_t> shape,
                         const void* data, size_t bytes) {
  const auto hold = impl_->write_hold();
  bool from_device = false;
  const auto target = impl_->validate(name, dtype, shape, data, bytes, from_device);
  if (target) impl_->write_slot(*target, data, bytes, from_device);
  return target.has_value();
}

bool WeightStore::update(std::span<const io::TensorView> tensors) {
  // (one hold for the whole call: a reader sees all of its tensors or none)
  const auto hold = impl_->write_hold();
  struct Checked {
    std::optional<std::pair<uint32_t, uint32_t>> target;
    bool from_device = false;
  };
  std::vector<Checked> checked(tensors.size());
  std::unordered_set<std::string_view> names;
  for (size_t i = 0; i < tensors.size(); ++i) {  // (all of them checked before a byte is written)
    const io::TensorView& v = tensors[i];
    if (!names.insert(v.name).second)
      throw io::FormatError(fmt::format(
          "WeightStore::update: tensor '{}' is given twice in one call (which one is meant?)", v.name));
    checked[i].target = impl_->validate(v.name, v.dtype, v.shape, v.data, v.bytes, checked[i].from_device);
  }
  bool any = false;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (checked[i].target) {
      impl_->write_slot(*checked[i].target, tensors[i].data, tensors[i].bytes, checked[i].from_device);
      any = true;
    }
  return any;
}

FinishReport WeightStore::finish() {
  Impl& m = *impl_;
  const auto hold = m.write_hold();
  if (!m.session) throw std::logic_error("WeightStore::finish: no session (call begin())");
  m.close_session();
  std::vector<std::string> problems;
  for (Layer& l : m.layers) {
    // Half pairs, every one of them: the caller must learn which update was lost.
    for (size_t s : Impl::half_pairs(l)) {
      const int p = l.info[s].partner;
      if (l.arrived[s])
        problems.push_back(fmt::format("layer {}: tensor '{}' arrived without its block scale '{}'", l.index,
                                       l.slots[s].name, l.slots[size_t(p)].name));
      else
        problems.push_back(fmt::format("layer {}: block scale '{}' arrived without its weight '{}'", l.index,
                                       l.slots[size_t(p)].name, l.slots[s].name));
    }
    if (l.ready) continue;
    // A layer that is not whole: the tensors neither of whose parts came.
    std::vector<std::string_view> missing;
    for (size_t s = 0; s < l.slots.size(); ++s) {
      const int p = l.info[s].partner;
      if (!l.arrived[s] && (p < 0 || !l.arrived[size_t(p)])) missing.push_back(l.slots[s].name);
    }
    if (missing.empty()) continue;
    std::string list;
    for (size_t i = 0; i < missing.size() && i < kMaxMissingListed; ++i)
      list += fmt::format(" '{}'", missing[i]);
    if (missing.size() > kMaxMissingListed)
      list += fmt::format(" ... and {} more", missing.size() - kMaxMissingListed);
    problems.push_back(fmt::format("layer {}: {} missing tensor{} ({}):{}", l.index, missing.size(),
                                   missing.size() == 1 ? "" : "s",
                                   l.touched     ? "layer incomplete after this session"
                                   : l.was_ready ? "left incomplete by an earlier session"
                                                 : "never loaded",
                                   list));
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("WeightStore::finish ({} session): {} problem{}", to_string(m.mode),
                                  problems.size(), problems.size() == 1 ? "" : "s");
    for (const auto& p : problems) msg += "\n  " + p;
    throw io::NotFoundError(msg);
  }
  return m.report;
}

FinishReport WeightStore::load(const io::Checkpoint& ckpt, const LoadOptions& opt) {
  Impl& m = *impl_;
  struct Item {
    size_t file;
    const io::TensorInfo* t;
  };
  // Resolve first: an unexpected tensor fails before a byte is copied.
  std::vector<Item> items;
  size_t total = 0;
  for (size_t f = 0; f < ckpt.num_files(); ++f)
    for (const io::TensorInfo& t : ckpt.file(f).tensors())
      if (m.resolve(t.name)) items.push_back({f, &t}), total += t.bytes();

  begin(opt.mode);
  try {
    size_t done = 0;
    auto tick = [&](size_t n) {
      done += n;
      if (opt.progress) opt.progress(done, total);
    };
    if (opt.shuffle || m.device()) {
      if (opt.shuffle) {
        std::mt19937_64 rng(opt.seed);
        std::shuffle(items.begin(), items.end(), rng);
      }
      for (const Item& it : items) {
        update(ckpt.file(it.file).view(*it.t));
        tick(it.t->bytes());
      }
    } else {
      // Streaming: each shard once, in offset order, pread straight into the
      // live buffers (no mmap page-ins, no staging copy; each byte read once).
      std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
        return a.file != b.file ? a.file < b.file : a.t->begin < b.t->begin;
      });
      size_t i = 0;
      std::vector<uint8_t> staged;
      while (i < items.size()) {
        const io::SafetensorsFile& file = ckpt.file(items[i].file);
        const int fd = ::open(file.path().c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw io::Error(fmt::format("{}: open failed: {}", file.path(), std::strerror(errno)));
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        try {
          for (; i < items.size() && &ckpt.file(items[i].file) == &file; ++i) {
            const io::TensorInfo& t = *items[i].t;
            const auto hold = m.write_hold();
            const auto target = *m.resolve(t.name);
            Layer& l = m.layers[target.first];
            const TensorSlot& s = l.slots[target.second];
            m.check(l, s, t.name, t.dtype, t.shape, t.bytes(), true);
            m.touch(l);
            uint8_t* dst = l.base + s.at(l.layout);
            // Scales, router and bias go through `staged` for check_values (they are small);
            // the weights straight into the layout.
            const bool stage = Impl::has_checked_values(l, target.second);
            if (stage) staged.resize(t.bytes());
            uint8_t* into = stage ? staged.data() : dst;
            for (size_t got = 0; got < t.bytes();) {
              const ssize_t r =
                  ::pread(fd, into + got, t.bytes() - got, off_t(file.header().data_offset + t.begin + got));
              if (r < 0 && errno == EINTR) continue;
              if (r <= 0)
                throw io::Error(fmt::format("{}: tensor '{}': read failed at byte {}: {}", file.path(),
                                            t.name, got,
                                            r == 0 ? "unexpected end of file" : std::strerror(errno)));
              got += size_t(r);
            }
            if (stage) {
              m.check_values(l, target.second, t.name, staged.data());
              std::memcpy(dst, staged.data(), t.bytes());
            }
            ++m.report.tensors, m.report.bytes += t.bytes();
            m.arrived(l, target.second);
            tick(t.bytes());
          }
        } catch (...) {
          ::close(fd);
          throw;
        }
        ::close(fd);
      }
    }
  } catch (...) {
    const auto hold = m.write_hold();
    m.close_session();
    throw;
  }
  return finish();
}

// ---------------------------------------------------------------- accessors

const std::vector<int>& WeightStore::layers() const { return impl_->layer_ids; }
bool WeightStore::holds(int layer) const { return impl_->by_layer.count(layer) != 0; }
const MoeShape& WeightStore::shape(int layer) const { return impl_->layer(layer).shape; }
const MoeWeightLayout& WeightStore::layout(int layer) const { return impl_->layer(layer).layout; }
StoreMemory WeightStore::memory() const { return impl_->opt.memory; }
KernelFormat WeightStore::kernel_format() const { return impl_->opt.kernel_format; }
const void* WeightStore::base(int layer) const { return impl_->layer(layer).base; }

const void* WeightStore::mxfp8_base(int layer) const {
  const Layer& l = impl_->layer(layer);
  return impl_->mxfp8() ? l.base + l.mx_offset : nullptr;
}
const Mxfp8Layout& WeightStore::mxfp8_layout(int layer) const { return impl_->layer(layer).mx; }

num::RequantReport WeightStore::mxfp8_report(int layer) const {
  std::lock_guard g(impl_->mu);
  const Layer& l = impl_->layer(layer);
  num::RequantReport total;
  for (size_t s = 0; s < l.slots.size(); ++s)
    if (l.info[s].mx_q) total += l.pair_reports[s];
  return total;
}

bool WeightStore::ready(int layer) const {
  std::lock_guard g(impl_->mu);
  return impl_->layer(layer).usable();
}

MoeWeightsView WeightStore::host_view(int layer) const {
  if (impl_->device()) throw std::logic_error("WeightStore::host_view: the store holds device memory");
  const Layer& l = impl_->layer(layer);
  if (!l.layout.whole(l.shape))
    throw std::logic_error(fmt::format("WeightStore::host_view: layer {} holds {} (no whole-layer view)",
                                       layer, l.layout.experts_text(l.shape)));
  return MoeWeightsView::at(l.base, l.layout, l.shape);
}

std::shared_lock<std::shared_mutex> WeightStore::read_lock() const {
  return std::shared_lock(impl_->bytes_mu);
}

HostMoeWeights WeightStore::to_host(int layer) const {
  const Layer& l = impl_->layer(layer);
  HostMoeWeights w(l.shape, l.layout.experts);
  read_bytes(layer, 0, l.layout.total_bytes, w.data());
  return w;
}

void WeightStore::read_bytes(int layer, size_t offset, size_t bytes, void* dst) const {
  const Layer& l = impl_->layer(layer);
  if (offset > l.alloc_bytes || bytes > l.alloc_bytes - offset)
    throw std::out_of_range(fmt::format("WeightStore::read_bytes: [{}, {}) outside layer {}'s {} bytes",
                                        offset, offset + bytes, layer, l.alloc_bytes));
  if (impl_->device())
    dev::copy_to_host(dst, l.base + offset, bytes);
  else
    std::memcpy(dst, l.base + offset, bytes);
}

size_t WeightStore::allocation_bytes(int layer) const { return impl_->layer(layer).alloc_bytes; }

size_t WeightStore::total_bytes() const {
  size_t n = 0;
  for (const Layer& l : impl_->layers) n += l.alloc_bytes;
  return n;
}

void WeightStore::zero_experts(int layer) {
  Impl& m = *impl_;
  const auto hold = m.write_hold();
  Layer& l = m.layer(layer);
  const MoeWeightLayout& lo = l.layout;
  auto zero = [&](size_t off, size_t n) {
    if (m.device())
      dev::device_memset(l.base + off, 0, n);
    else
      std::memset(l.base + off, 0, n);
  };
  for (const Region* r : {&lo.w13, &lo.w13_scale, &lo.w2, &lo.w2_scale, &lo.shared_w13, &lo.shared_w13_scale,
                          &lo.shared_w2, &lo.shared_w2_scale})
    zero(r->offset, r->bytes);
  zero(l.mx_offset, l.mx.total_bytes);
  std::fill(l.pair_reports.begin(), l.pair_reports.end(), num::RequantReport{});
  l.ready = false;
}

HostMoeWeights load_layer_via_store(const io::Checkpoint& ckpt, const ModelDesc& desc, int layer) {
  desc.require_moe_layer(layer);
  WeightStoreOptions opt;
  opt.layers = {layer};
  WeightStore store = WeightStore::for_checkpoint(ckpt, desc, opt);
  store.load(ckpt);
  return store.to_host(layer);
}

}  // namespace megamoe
