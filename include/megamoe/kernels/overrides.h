// The environment switches of the library, read in one place (docs/tuning.md lists them).
// Every MEGAMOE_* variable the library reads is a field here, read once per process at first
// use; an unset field leaves the rule (src/kernels/heuristics.h) its choice. A malformed value
// throws std::invalid_argument naming the variable, the expected and the found value.
// Tests set variants through ScopedOverrides, never through setenv.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace megamoe::kernels {

// The router GEMM's tile shape (route.cu; every shape gives the same bits).
enum class RouteTile { kSmall, kWide, kMedium, kLarge };

struct Overrides {
  // ---- the tile configuration (resolve_config, each forward); all keep the output bytes ----
  std::optional<int> block_n;               // MEGAMOE_BLOCK_N: 8, 16, 32, 48, 64 or 128 tokens a tile
  std::optional<bool> half_tiles;           // MEGAMOE_HALF_TILES=0|1
  std::optional<bool> wide_tiles;           // MEGAMOE_WIDE_TILES=0|1
  std::optional<bool> pair_tiles;           // MEGAMOE_PAIR_TILES=0|1 (128-token tiles only)
  std::optional<bool> pair_weights;         // MEGAMOE_PAIR_WEIGHTS=0|1 (what a pair tile shares)
  std::optional<bool> decode_pairs;         // MEGAMOE_DECODE_PAIRS=0|1 (block_n 8 and 16 only)
  std::optional<bool> programmatic_launch;  // MEGAMOE_PROGRAMMATIC_LAUNCH=0|1 (alias MEGAMOE_PDL)
  std::optional<double> read_gbps_per_sm;   // MEGAMOE_READ_GBPS_PER_SM: the card's figure, > 0

  // ---- the plan (read when a layer is made); all keep the output bytes ----
  std::optional<int> num_sms;              // MEGAMOE_NUM_SMS: a smaller persistent grid, >= 1
  std::optional<bool> sm_units;            // MEGAMOE_SM_UNITS=0|1 (1: where the probe's table holds)
  std::optional<int> sm_units_max_tokens;  // MEGAMOE_SM_UNITS_MAX_TOKENS, >= 0
  std::optional<int> unit_stride;          // MEGAMOE_UNIT_STRIDE, >= 0 (0: the SM's id; no sm_units)
  std::optional<int> unit_turn;            // MEGAMOE_UNIT_TURN, even, >= 0
  std::optional<int> tail_pool;            // MEGAMOE_TAIL_POOL, >= 0
  std::optional<bool> ep_wide_tiles;       // MEGAMOE_EP_WIDE_TILES=0|1 (alias MEGAMOE_EP_WIDE)
  std::optional<bool> ep_overlap;          // MEGAMOE_EP_OVERLAP=0|1
  std::optional<RouteTile> route_tile;     // MEGAMOE_ROUTE_TILE=small|wide|medium|large

  // ---- measurement only ----
  int debug_stop = 0;                 // MEGAMOE_DEBUG_STOP=0..3: WRONG outputs unless 0
  int debug_skip = 0;                 // MEGAMOE_DEBUG_SKIP: bits 1|4|8|16, WRONG outputs unless 0
  std::optional<bool> round_robin;    // MEGAMOE_ROUND_ROBIN=0|1 (alias MEGAMOE_SCHEDULE=rr)
  std::optional<bool> early_weights;  // MEGAMOE_EARLY_WEIGHTS=0|1

  // ---- reports and the NCCL transport ----
  bool print_config = false;            // MEGAMOE_PRINT_CONFIG=0|1
  std::optional<std::string> nccl_lib;  // MEGAMOE_NCCL_LIB: the NCCL library to load
  // Where Python environments live, for the NCCL transport's search of PyTorch's NCCL (not
  // switches of ours: read here so the library reads its environment in one place).
  std::optional<std::string> virtual_env;   // VIRTUAL_ENV (unset where empty)
  std::optional<std::string> conda_prefix;  // CONDA_PREFIX (unset where empty)

  // Reads every switch through `get` (getenv's contract: nullptr where unset); throws on a
  // malformed value or an alias that contradicts its name.
  static Overrides parse(const std::function<const char*(const char*)>& get);
  // The set fields as NAME=value, space separated ("" when none).
  std::string describe() const;
};

// The process's switches: the environment's, read at the first call, or a test's
// (ScopedOverrides). Not to be changed while another thread runs a forward or makes a layer.
const Overrides& overrides();

// Replaces the process's switches while alive (the fields unset here are unset, whatever the
// environment says) and restores the previous ones after; nests.
class ScopedOverrides {
 public:
  explicit ScopedOverrides(const Overrides& o);
  ~ScopedOverrides();
  ScopedOverrides(const ScopedOverrides&) = delete;
  ScopedOverrides& operator=(const ScopedOverrides&) = delete;

 private:
  std::optional<Overrides> previous_;
};

}  // namespace megamoe::kernels
