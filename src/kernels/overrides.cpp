// The only reader of the library's environment (include/megamoe/kernels/overrides.h).
#include "megamoe/kernels/overrides.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iterator>
#include <stdexcept>
#include <string_view>

namespace megamoe::kernels {
namespace {

// MEGAMOE_ROUTE_TILE's values, in RouteTile's order.
constexpr const char* kRouteTileNames[] = {"small", "wide", "medium", "large"};

[[noreturn]] void bad_value(const char* name, const char* expected, const char* found) {
  throw std::invalid_argument(fmt::format("{}: expected {}, found \"{}\"", name, expected, found));
}

// A whole decimal integer (no trailing characters), in [lo, hi].
int parse_int(const char* name, const char* v, long lo, long hi, const char* expected) {
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || errno == ERANGE || x < lo || x > hi) bad_value(name, expected, v);
  return int(x);
}

bool parse_bool(const char* name, const char* v) {
  const std::string s(v);
  if (s == "0") return false;
  if (s == "1") return true;
  bad_value(name, "0 or 1", v);
}

// A switch with an older name: either may be set; both set, they must agree.
template <typename T, typename Parse>
std::optional<T> with_alias(const std::function<const char*(const char*)>& get, const char* name,
                            const char* alias, Parse parse) {
  const char* v = get(name);
  const char* a = get(alias);
  std::optional<T> out;
  if (v) out = parse(name, v);
  if (a) {
    const T x = parse(alias, a);
    if (out && *out != x)
      throw std::invalid_argument(
          fmt::format("{}=\"{}\" contradicts its older name {}=\"{}\"", name, v, alias, a));
    out = x;
  }
  return out;
}

std::optional<Overrides>& test_overrides() {
  static std::optional<Overrides> o;
  return o;
}

}  // namespace

Overrides Overrides::parse(const std::function<const char*(const char*)>& get) {
  Overrides o;
  auto flag = [&](const char* name) -> std::optional<bool> {
    const char* v = get(name);
    return v ? std::optional<bool>(parse_bool(name, v)) : std::nullopt;
  };
  auto count = [&](const char* name, long lo, long hi, const char* expected) -> std::optional<int> {
    const char* v = get(name);
    return v ? std::optional<int>(parse_int(name, v, lo, hi, expected)) : std::nullopt;
  };

  if (const char* v = get("MEGAMOE_BLOCK_N")) {
    // (heuristics.h kBlockNs: one kernel instantiation each)
    const int bn = parse_int("MEGAMOE_BLOCK_N", v, 1, 128, "one of 8, 16, 32, 48, 64, 128");
    if (bn != 8 && bn != 16 && bn != 32 && bn != 48 && bn != 64 && bn != 128)
      bad_value("MEGAMOE_BLOCK_N", "one of 8, 16, 32, 48, 64, 128", v);
    o.block_n = bn;
  }
  o.half_tiles = flag("MEGAMOE_HALF_TILES");
  o.wide_tiles = flag("MEGAMOE_WIDE_TILES");
  o.pair_tiles = flag("MEGAMOE_PAIR_TILES");
  o.pair_weights = flag("MEGAMOE_PAIR_WEIGHTS");
  o.decode_pairs = flag("MEGAMOE_DECODE_PAIRS");
  o.programmatic_launch = with_alias<bool>(get, "MEGAMOE_PROGRAMMATIC_LAUNCH", "MEGAMOE_PDL", parse_bool);
  if (const char* v = get("MEGAMOE_READ_GBPS_PER_SM")) {
    char* end = nullptr;
    const double g = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(g > 0 && g < 1e6))
      bad_value("MEGAMOE_READ_GBPS_PER_SM", "a number of GB/s per SM > 0", v);
    o.read_gbps_per_sm = g;
  }

  o.num_sms = count("MEGAMOE_NUM_SMS", 1, 1 << 20, "an SM count >= 1");
  o.sm_units = flag("MEGAMOE_SM_UNITS");
  o.sm_units_max_tokens = count("MEGAMOE_SM_UNITS_MAX_TOKENS", 0, 1 << 30, "a token count >= 0");
  o.unit_stride = count("MEGAMOE_UNIT_STRIDE", 0, 1 << 20, "a stride >= 0 coprime to the grid");
  if (const char* v = get("MEGAMOE_UNIT_TURN")) {
    // (the table's units come in TPC pairs)
    const int t = parse_int("MEGAMOE_UNIT_TURN", v, 0, 1 << 20, "an even count >= 0");
    if (t % 2 != 0) bad_value("MEGAMOE_UNIT_TURN", "an even count >= 0", v);
    o.unit_turn = t;
  }
  o.tail_pool = count("MEGAMOE_TAIL_POOL", 0, 1 << 20, "a tile count >= 0");
  o.ep_wide_tiles = with_alias<bool>(get, "MEGAMOE_EP_WIDE_TILES", "MEGAMOE_EP_WIDE", parse_bool);
  o.ep_overlap = flag("MEGAMOE_EP_OVERLAP");
  if (const char* v = get("MEGAMOE_ROUTE_TILE")) {
    const auto* at = std::find(std::begin(kRouteTileNames), std::end(kRouteTileNames), std::string_view(v));
    if (at == std::end(kRouteTileNames)) bad_value("MEGAMOE_ROUTE_TILE", "small, wide, medium or large", v);
    o.route_tile = RouteTile(at - std::begin(kRouteTileNames));
  }

  if (const char* v = get("MEGAMOE_DEBUG_STOP"))
    o.debug_stop = parse_int("MEGAMOE_DEBUG_STOP", v, 0, 3, "0, 1, 2 or 3");
  if (const char* v = get("MEGAMOE_DEBUG_SKIP")) {
    // (fused_moe_device.cuh kSkipMma | kSkipLoads | kSkipFold | kSkipDeps)
    const int bits = parse_int("MEGAMOE_DEBUG_SKIP", v, 0, 31, "a sum of the bits 1, 4, 8, 16");
    if (bits & 2) bad_value("MEGAMOE_DEBUG_SKIP", "a sum of the bits 1, 4, 8, 16", v);
    o.debug_skip = bits;
  }
  o.round_robin =
      with_alias<bool>(get, "MEGAMOE_ROUND_ROBIN", "MEGAMOE_SCHEDULE", [](const char* n, const char* v) {
        // (the older name's values: rr, or the balanced schedule's name)
        if (std::string(n) == "MEGAMOE_SCHEDULE") {
          const std::string s(v);
          if (s == "rr") return true;
          if (s == "balanced") return false;
          bad_value(n, "rr or balanced", v);
        }
        return parse_bool(n, v);
      });
  o.early_weights = flag("MEGAMOE_EARLY_WEIGHTS");

  o.print_config = flag("MEGAMOE_PRINT_CONFIG").value_or(false);
  if (const char* v = get("MEGAMOE_NCCL_LIB")) {
    if (*v == '\0') bad_value("MEGAMOE_NCCL_LIB", "a library name or path", v);
    o.nccl_lib = std::string(v);
  }
  for (auto [name, field] : {std::pair{"VIRTUAL_ENV", &Overrides::virtual_env},
                             std::pair{"CONDA_PREFIX", &Overrides::conda_prefix}})
    if (const char* v = get(name); v && *v) o.*field = std::string(v);
  return o;
}

std::string Overrides::describe() const {
  std::string s;
  auto add = [&](const char* name, const auto& v) {
    if (v) s += fmt::format("{}{}={}", s.empty() ? "" : " ", name, *v);
  };
  auto add_flag = [&](const char* name, const std::optional<bool>& v) {
    if (v) s += fmt::format("{}{}={}", s.empty() ? "" : " ", name, *v ? 1 : 0);
  };
  add("MEGAMOE_BLOCK_N", block_n);
  add_flag("MEGAMOE_HALF_TILES", half_tiles);
  add_flag("MEGAMOE_WIDE_TILES", wide_tiles);
  add_flag("MEGAMOE_PAIR_TILES", pair_tiles);
  add_flag("MEGAMOE_PAIR_WEIGHTS", pair_weights);
  add_flag("MEGAMOE_DECODE_PAIRS", decode_pairs);
  add_flag("MEGAMOE_PROGRAMMATIC_LAUNCH", programmatic_launch);
  add("MEGAMOE_READ_GBPS_PER_SM", read_gbps_per_sm);
  add("MEGAMOE_NUM_SMS", num_sms);
  add_flag("MEGAMOE_SM_UNITS", sm_units);
  add("MEGAMOE_SM_UNITS_MAX_TOKENS", sm_units_max_tokens);
  add("MEGAMOE_UNIT_STRIDE", unit_stride);
  add("MEGAMOE_UNIT_TURN", unit_turn);
  add("MEGAMOE_TAIL_POOL", tail_pool);
  add_flag("MEGAMOE_EP_WIDE_TILES", ep_wide_tiles);
  add_flag("MEGAMOE_EP_OVERLAP", ep_overlap);
  if (route_tile) {
    add("MEGAMOE_ROUTE_TILE", std::optional<const char*>(kRouteTileNames[int(*route_tile)]));
  }
  add("MEGAMOE_DEBUG_STOP", debug_stop ? std::optional<int>(debug_stop) : std::nullopt);
  add("MEGAMOE_DEBUG_SKIP", debug_skip ? std::optional<int>(debug_skip) : std::nullopt);
  add_flag("MEGAMOE_ROUND_ROBIN", round_robin);
  add_flag("MEGAMOE_EARLY_WEIGHTS", early_weights);
  if (print_config) add_flag("MEGAMOE_PRINT_CONFIG", std::optional<bool>(true));
  add("MEGAMOE_NCCL_LIB", nccl_lib);
  add("VIRTUAL_ENV", virtual_env);
  add("CONDA_PREFIX", conda_prefix);
  return s;
}

const Overrides& overrides() {
  if (const auto& t = test_overrides()) return *t;
  // (a throw leaves it unset: the next call reads again and throws again)
  static const Overrides env = Overrides::parse([](const char* name) { return std::getenv(name); });
  return env;
}

ScopedOverrides::ScopedOverrides(const Overrides& o) : previous_(test_overrides()) { test_overrides() = o; }

ScopedOverrides::~ScopedOverrides() { test_overrides() = previous_; }

}  // namespace megamoe::kernels
