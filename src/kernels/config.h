// The one configuration step of the fused forward: every decision (tiles, stages, clusters,
// the schedule's units, the measurement switches) as pure functions of the shape, the token
// bound, the card and the switches (Overrides, read once at the API edge and passed in).
// Plan creation, the forward, MEGAMOE_PRINT_CONFIG and the bench all take their configuration
// from here; the rules and their reasons are heuristics.h. No CUDA: tests/cpu/test_decisions.cpp
// checks the table of decisions on any machine.
#pragma once

#include <string>

#include "heuristics.h"
#include "megamoe/kernels/config.h"
#include "megamoe/kernels/overrides.h"
#include "megamoe/model/shape.h"

namespace megamoe::kernels {

// What the configuration reads of the GPU. The plan fills it from the device
// (fused_moe_plan_create); the decision table names cards.
struct CardInfo {
  int sms = 0;                  // streaming multiprocessors
  int smem_per_sm = 0;          // shared memory of an SM in bytes
  double read_gbps_per_sm = 0;  // peak DRAM bandwidth per SM in GB/s (0: unknown)
  // What the plan learns by asking the card (true on an idle H100 or H200):
  bool clusters_resident = true;  // the grid's clusters of two CTAs are resident at once
  bool sm_unit_table = true;      // the SM-unit probe found its table (probed where sm_units_wanted)
};

// The inputs of every decision about one layer's forwards but the token count.
struct ConfigInputs {
  MoeShape shape;
  int ep_ranks = 0;  // 0: every expert on this device; R: this rank computes E / R of them
  int grid_cap = 0;  // the caller's grid (FusedMoeConfig::num_sms at plan creation; 0: every SM)
  CardInfo card;
  Overrides switches;  // the environment's switches, read once at the API edge
};

// The kernel's measurement switches (docs/tuning.md; the Overrides of the same names): for timing
// the kernel's parts and probing its schedule. DebugArgs{} (these defaults) is the release
// kernel; stop and skip make the outputs wrong. Part of the kernel's arguments (KernelArgs).
struct DebugArgs {
  int stop = 0;  // MEGAMOE_DEBUG_STOP: 0 = full kernel; 1/2/3 stop after tables / phase 0 / the mainloop
  int skip = 0;  // MEGAMOE_DEBUG_SKIP: kSkipMma | kSkipLoads | kSkipFold | kSkipDeps (fused_moe_device.cuh)
  int round_robin = 0;  // MEGAMOE_ROUND_ROBIN=1: plain round-robin instead of TileSchedule's balance
  // MEGAMOE_EARLY_WEIGHTS (1): weight loads go out before the tile's tokens are ready; 0: they
  // wait with them.
  int early_weights = 1;
  int unit_stride = 1;  // MEGAMOE_UNIT_STRIDE: CTA b takes unit b * stride mod G (coprime to G; 0: %smid)
  // MEGAMOE_UNIT_TURN (even; 0 = off): with sm_units the units turn by this many a forward
  // (unit + turn * epoch mod G, epoch = the routing's forward count), as a plain launch's
  // starting SM moves from launch to launch.
  int unit_turn = 0;
};

// The persistent grid: every SM, or fewer (grid_cap, MEGAMOE_NUM_SMS).
int resolve_grid(const ConfigInputs& in);
// Whether the schedule's units may go by SM (FusedMoeConfig::sm_units) at all: the plan runs
// the SM-unit probe only where this holds (the grid covers the card, no unit stride).
bool sm_units_wanted(const ConfigInputs& in);
// The measurement switches (throws on a unit stride that is not coprime to the grid).
DebugArgs resolve_debug(const ConfigInputs& in);
// The configuration of a forward of `tokens` tokens (an expert-parallel rank's own count): the
// decision of every FusedMoeConfig field. Throws where a switch asks for what the shape cannot
// do (MEGAMOE_EP_OVERLAP=1 past the overlapped pull's tables).
FusedMoeConfig resolve_config(const ConfigInputs& in, int tokens);

// The inputs of one forward: the plan's, with the switches a forward reads (Overrides' tile
// configuration fields, route_tile and print_config) taken from `now`, the API edge's at the
// call; the plan's switches (the grid, the units, the measurement ones) stay the plan's.
ConfigInputs with_forward_switches(const ConfigInputs& plan, const Overrides& now);

// The configuration as MEGAMOE_PRINT_CONFIG prints it (each mechanism under its one name).
std::string describe(const FusedMoeConfig& c);
// One line on stderr where switches.print_config.
void maybe_print_config(const ConfigInputs& in, int tokens, const FusedMoeConfig& c);

}  // namespace megamoe::kernels
