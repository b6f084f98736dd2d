// The decision table of the fused forward's configuration (src/kernels/config.h,
// resolve_config): every preset x token count x card (and an expert-parallel rank) against
// tests/data/decisions_golden.txt, so a change of the rules shows as a diff of that file.
// Regenerate it after an intended change (docs/testing.md):
//   MEGAMOE_REGEN_GOLDEN=1 build/megamoe_tests --gtest_filter='Decisions.*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "../../src/kernels/config.h"  // the internal configuration step
#include "megamoe/model/shape.h"

namespace megamoe::kernels {
namespace {

struct NamedCard {
  const char* name;
  CardInfo card;
};

// Peak DRAM bandwidth per SM as device_read_gbps_per_sm computes it: 2 x memory clock x bus
// width / SMs (H100 SXM: 2619 MHz x 5120 bits; H200: 3201 MHz x 6144 bits; H100 PCIe: 1593 MHz
// x 5120 bits on 114 SMs).
CardInfo card(int sms, double mem_mhz, int bus_bits) {
  CardInfo c;
  c.sms = sms;
  c.smem_per_sm = 233472;  // sm_90: 228 KB
  c.read_gbps_per_sm = 2.0 * mem_mhz * 1e6 * (bus_bits / 8) / 1e9 / sms;
  return c;
}

const NamedCard kCards[] = {
    {"h100-sxm", card(132, 2619, 5120)},
    {"h200", card(132, 3201, 6144)},
    {"h100-pcie", card(114, 1593, 5120)},
};
const int kTokens[] = {1, 8, 64, 256, 1024, 4096, 8192, 16384};

std::string golden_path() { return std::string(MEGAMOE_TEST_DATA) + "/decisions_golden.txt"; }

// One line a decision: preset, card, ranks, tokens (a rank's own under expert parallelism),
// then the configuration as MEGAMOE_PRINT_CONFIG prints it, and the kernel's measurement args.
std::string decision_table() {
  std::ostringstream out;
  out << "# resolve_config: preset card ep_ranks tokens: configuration (tests/cpu/test_decisions.cpp)\n";
  for (const Preset& p : presets()) {
    for (const NamedCard& c : kCards) {
      for (int ranks : {0, 8}) {
        ConfigInputs in;
        in.shape = p.shape;
        in.ep_ranks = ranks;
        in.card = c.card;
        if (ranks && p.shape.experts % ranks != 0) continue;
        for (int t : kTokens) {
          const FusedMoeConfig cfg = resolve_config(in, t);
          out << p.name << ' ' << c.name << " ep" << ranks << " T=" << t << ": " << describe(cfg) << '\n';
        }
      }
    }
  }
  return out.str();
}

TEST(Decisions, TableMatchesGolden) {
  const std::string table = decision_table();
  if (const char* regen = std::getenv("MEGAMOE_REGEN_GOLDEN"); regen && std::string(regen) == "1") {
    std::ofstream(golden_path()) << table;
    GTEST_SKIP() << "wrote " << golden_path();
  }
  std::ifstream in(golden_path());
  ASSERT_TRUE(in) << "cannot open " << golden_path() << " (MEGAMOE_REGEN_GOLDEN=1 writes it)";
  std::stringstream want;
  want << in.rdbuf();
  // Line by line, so a changed rule names its rows.
  std::istringstream a(table), b(want.str());
  std::string got_line, want_line;
  int line = 0, bad = 0;
  while (true) {
    const bool more_a = bool(std::getline(a, got_line)), more_b = bool(std::getline(b, want_line));
    if (!more_a && !more_b) break;
    ++line;
    if (got_line != want_line && ++bad <= 20)
      ADD_FAILURE() << "line " << line << ":\n  golden: " << (more_b ? want_line : "(none)")
                    << "\n  now:    " << (more_a ? got_line : "(none)");
    if (!more_a) got_line.clear();
    if (!more_b) want_line.clear();
  }
  EXPECT_EQ(bad, 0) << bad << " decisions differ from " << golden_path()
                    << " (an intended change: MEGAMOE_REGEN_GOLDEN=1, docs/testing.md)";
}

// The rules docs/kernel.md states, checked on every row of the table without the snapshot:
// a built token block, the grid within the card, the ring within shared memory, decode tiles
// at 1 token and 128-token tiles at 16384, token blocks that never shrink as T grows, and at
// most one of the 128-token tile forms (pair, wide) chosen.
TEST(Decisions, TableKeepsTheRules) {
  for (const Preset& p : presets()) {
    for (const NamedCard& c : kCards) {
      for (int ranks : {0, 8}) {
        if (ranks && p.shape.experts % ranks != 0) continue;
        ConfigInputs in;
        in.shape = p.shape;
        in.ep_ranks = ranks;
        in.card = c.card;
        int last_block_n = 0;
        for (int t : kTokens) {
          const FusedMoeConfig cfg = resolve_config(in, t);
          const std::string at =
              std::string(p.name) + " " + c.name + " ep" + std::to_string(ranks) + " T=" + std::to_string(t);
          EXPECT_NE(std::find(std::begin(kBlockNs), std::end(kBlockNs), cfg.block_n), std::end(kBlockNs))
              << at;
          EXPECT_GE(cfg.block_n, last_block_n) << at;
          last_block_n = cfg.block_n;
          EXPECT_GE(cfg.num_sms, 1) << at;
          EXPECT_LE(cfg.num_sms, c.card.sms) << at;
          EXPECT_GE(cfg.stages, 2) << at;
          EXPECT_LE(fixed_smem_bytes(cfg.block_n) + cfg.stages * stage_bytes(cfg.block_n, cfg.wide_tiles),
                    kSmemBudget)
              << at;
          EXPECT_FALSE(cfg.pair_tiles && cfg.wide_tiles) << at;
          if (cfg.block_n < 128) {
            EXPECT_FALSE(cfg.pair_tiles || cfg.wide_tiles || cfg.half_tiles) << at;
          }
          if (t == 1) {
            EXPECT_LT(cfg.block_n, 128) << at;
          }
          if (t == 16384 && !ranks) {
            EXPECT_EQ(cfg.block_n, 128) << at;
          }
        }
      }
    }
  }
}

// The function reads its inputs only: the process's switches (ScopedOverrides) change nothing,
// the switches passed in do.
TEST(Decisions, PureOfItsInputs) {
  ConfigInputs in;
  in.shape = find_preset("glm-5").shape;
  in.card = kCards[0].card;
  const std::string plain = describe(resolve_config(in, 4096));
  Overrides ov;
  ov.block_n = 64;
  {
    const ScopedOverrides scoped(ov);
    EXPECT_EQ(describe(resolve_config(in, 4096)), plain);
  }
  in.switches = ov;
  const FusedMoeConfig forced = resolve_config(in, 4096);
  EXPECT_EQ(forced.block_n, 64);
  EXPECT_FALSE(forced.pair_tiles || forced.wide_tiles);
  // A forward's tile switches come from the call, the plan's (the grid) from the plan.
  Overrides now;
  now.block_n = 16;
  now.num_sms = 8;
  const ConfigInputs fwd = with_forward_switches(in, now);
  EXPECT_EQ(resolve_config(fwd, 4096).block_n, 16);
  EXPECT_EQ(resolve_config(fwd, 4096).num_sms, 132);
  // A stride that is not coprime to the grid is refused; the release arguments are DebugArgs{}.
  in.switches = Overrides{};
  const DebugArgs d = resolve_debug(in);
  EXPECT_EQ(d.stop, 0);
  EXPECT_EQ(d.skip, 0);
  EXPECT_EQ(d.unit_stride, 1);
  in.switches.unit_stride = 2;
  EXPECT_THROW(resolve_debug(in), std::invalid_argument);
}

}  // namespace
}  // namespace megamoe::kernels
