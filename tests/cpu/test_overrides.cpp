// The environment switches (megamoe/kernels/overrides.h): parsed from a fake environment,
// malformed values refused naming the variable, older names kept as aliases, the test hook.
#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <string>

#include "megamoe/kernels/overrides.h"

namespace megamoe::kernels {
namespace {

Overrides parse_env(const std::map<std::string, std::string>& env) {
  return Overrides::parse([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The message of the std::invalid_argument that parsing `env` throws ("" when none).
std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    parse_env(env);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Overrides, NothingSetLeavesEveryChoiceToTheRule) {
  const Overrides o = parse_env({});
  EXPECT_FALSE(o.block_n || o.half_tiles || o.wide_tiles || o.pair_tiles || o.pair_weights ||
               o.decode_pairs || o.programmatic_launch || o.read_gbps_per_sm || o.num_sms || o.sm_units ||
               o.sm_units_max_tokens || o.unit_stride || o.unit_turn || o.tail_pool || o.ep_wide_tiles ||
               o.ep_overlap || o.route_tile || o.round_robin || o.early_weights || o.nccl_lib ||
               o.virtual_env || o.conda_prefix);
  EXPECT_EQ(o.debug_stop, 0);
  EXPECT_EQ(o.debug_skip, 0);
  EXPECT_FALSE(o.print_config);
  EXPECT_EQ(o.describe(), "");
}

TEST(Overrides, EverySwitchParses) {
  const Overrides o = parse_env({{"MEGAMOE_BLOCK_N", "48"},
                                 {"MEGAMOE_HALF_TILES", "0"},
                                 {"MEGAMOE_WIDE_TILES", "1"},
                                 {"MEGAMOE_PAIR_TILES", "0"},
                                 {"MEGAMOE_PAIR_WEIGHTS", "1"},
                                 {"MEGAMOE_DECODE_PAIRS", "0"},
                                 {"MEGAMOE_PROGRAMMATIC_LAUNCH", "1"},
                                 {"MEGAMOE_READ_GBPS_PER_SM", "36.5"},
                                 {"MEGAMOE_NUM_SMS", "66"},
                                 {"MEGAMOE_SM_UNITS", "0"},
                                 {"MEGAMOE_SM_UNITS_MAX_TOKENS", "16384"},
                                 {"MEGAMOE_UNIT_STRIDE", "0"},
                                 {"MEGAMOE_UNIT_TURN", "38"},
                                 {"MEGAMOE_TAIL_POOL", "16"},
                                 {"MEGAMOE_EP_WIDE_TILES", "0"},
                                 {"MEGAMOE_EP_OVERLAP", "1"},
                                 {"MEGAMOE_ROUTE_TILE", "wide"},
                                 {"MEGAMOE_DEBUG_STOP", "2"},
                                 {"MEGAMOE_DEBUG_SKIP", "13"},
                                 {"MEGAMOE_ROUND_ROBIN", "1"},
                                 {"MEGAMOE_EARLY_WEIGHTS", "0"},
                                 {"MEGAMOE_PRINT_CONFIG", "1"},
                                 {"MEGAMOE_NCCL_LIB", "/opt/nccl/lib/libnccl.so.2"},
                                 {"VIRTUAL_ENV", "/opt/venv"},
                                 {"CONDA_PREFIX", ""}});
  EXPECT_EQ(o.block_n, 48);
  EXPECT_EQ(o.half_tiles, false);
  EXPECT_EQ(o.wide_tiles, true);
  EXPECT_EQ(o.pair_tiles, false);
  EXPECT_EQ(o.pair_weights, true);
  EXPECT_EQ(o.decode_pairs, false);
  EXPECT_EQ(o.programmatic_launch, true);
  EXPECT_EQ(o.read_gbps_per_sm, 36.5);
  EXPECT_EQ(o.num_sms, 66);
  EXPECT_EQ(o.sm_units, false);
  EXPECT_EQ(o.sm_units_max_tokens, 16384);
  EXPECT_EQ(o.unit_stride, 0);
  EXPECT_EQ(o.unit_turn, 38);
  EXPECT_EQ(o.tail_pool, 16);
  EXPECT_EQ(o.ep_wide_tiles, false);
  EXPECT_EQ(o.ep_overlap, true);
  EXPECT_EQ(o.route_tile, RouteTile::kWide);
  EXPECT_EQ(o.debug_stop, 2);
  EXPECT_EQ(o.debug_skip, 13);
  EXPECT_EQ(o.round_robin, true);
  EXPECT_EQ(o.early_weights, false);
  EXPECT_TRUE(o.print_config);
  EXPECT_EQ(o.nccl_lib, "/opt/nccl/lib/libnccl.so.2");
  EXPECT_EQ(o.virtual_env, "/opt/venv");
  EXPECT_FALSE(o.conda_prefix);  // (empty: unset)
  // describe() names every set switch as it is spelled in the environment.
  const std::string d = o.describe();
  for (const char* part : {"MEGAMOE_BLOCK_N=48", "MEGAMOE_WIDE_TILES=1", "MEGAMOE_PROGRAMMATIC_LAUNCH=1",
                           "MEGAMOE_ROUTE_TILE=wide", "MEGAMOE_DEBUG_SKIP=13", "MEGAMOE_EARLY_WEIGHTS=0",
                           "MEGAMOE_NCCL_LIB=/opt/nccl/lib/libnccl.so.2"})
    EXPECT_NE(d.find(part), std::string::npos) << part << " not in " << d;
}

TEST(Overrides, OlderNamesAreAliases) {
  EXPECT_EQ(parse_env({{"MEGAMOE_PDL", "0"}}).programmatic_launch, false);
  EXPECT_EQ(parse_env({{"MEGAMOE_PDL", "1"}, {"MEGAMOE_PROGRAMMATIC_LAUNCH", "1"}}).programmatic_launch,
            true);
  EXPECT_EQ(parse_env({{"MEGAMOE_EP_WIDE", "0"}}).ep_wide_tiles, false);
  EXPECT_EQ(parse_env({{"MEGAMOE_SCHEDULE", "rr"}}).round_robin, true);
  EXPECT_EQ(parse_env({{"MEGAMOE_SCHEDULE", "balanced"}}).round_robin, false);
  // An alias contradicting its name is refused, naming both.
  const std::string e = error_of({{"MEGAMOE_PDL", "0"}, {"MEGAMOE_PROGRAMMATIC_LAUNCH", "1"}});
  EXPECT_NE(e.find("MEGAMOE_PROGRAMMATIC_LAUNCH"), std::string::npos) << e;
  EXPECT_NE(e.find("MEGAMOE_PDL"), std::string::npos) << e;
}

TEST(Overrides, MalformedValuesNameTheVariableTheExpectedAndTheFound) {
  struct Bad {
    const char *name, *value, *expected;
  };
  for (const Bad& b :
       {Bad{"MEGAMOE_BLOCK_N", "12", "8, 16, 32, 48, 64, 128"},
        Bad{"MEGAMOE_BLOCK_N", "128x", "8, 16, 32, 48, 64, 128"},
        Bad{"MEGAMOE_BLOCK_N", "", "8, 16, 32, 48, 64, 128"}, Bad{"MEGAMOE_HALF_TILES", "yes", "0 or 1"},
        Bad{"MEGAMOE_PAIR_TILES", "2", "0 or 1"}, Bad{"MEGAMOE_PDL", "true", "0 or 1"},
        Bad{"MEGAMOE_READ_GBPS_PER_SM", "-3", "GB/s"}, Bad{"MEGAMOE_READ_GBPS_PER_SM", "nan", "GB/s"},
        Bad{"MEGAMOE_NUM_SMS", "0", ">= 1"}, Bad{"MEGAMOE_UNIT_TURN", "37", "even"},
        Bad{"MEGAMOE_UNIT_STRIDE", "-1", ">= 0"}, Bad{"MEGAMOE_TAIL_POOL", "99999999999", ">= 0"},
        Bad{"MEGAMOE_ROUTE_TILE", "huge", "small, wide, medium or large"},
        Bad{"MEGAMOE_DEBUG_STOP", "4", "0, 1, 2 or 3"}, Bad{"MEGAMOE_DEBUG_SKIP", "2", "1, 4, 8, 16"},
        Bad{"MEGAMOE_SCHEDULE", "static", "rr or balanced"}, Bad{"MEGAMOE_NCCL_LIB", "", "library"}}) {
    const std::string e = error_of({{b.name, b.value}});
    EXPECT_NE(e.find(b.name), std::string::npos) << b.name << "=" << b.value << ": " << e;
    EXPECT_NE(e.find(b.expected), std::string::npos) << b.name << "=" << b.value << ": " << e;
    EXPECT_NE(e.find(std::string("\"") + b.value + "\""), std::string::npos) << b.name << ": " << e;
  }
}

TEST(Overrides, ScopedOverridesReplaceAndRestoreNested) {
  const Overrides before = overrides();  // (the test process's environment)
  Overrides a;
  a.block_n = 64;
  {
    const ScopedOverrides sa(a);
    EXPECT_EQ(overrides().block_n, 64);
    EXPECT_FALSE(overrides().print_config);
    Overrides b = overrides();
    b.wide_tiles = false;
    {
      const ScopedOverrides sb(b);
      EXPECT_EQ(overrides().block_n, 64);
      EXPECT_EQ(overrides().wide_tiles, false);
    }
    EXPECT_EQ(overrides().block_n, 64);
    EXPECT_FALSE(overrides().wide_tiles);
  }
  EXPECT_EQ(overrides().describe(), before.describe());
}

}  // namespace
}  // namespace megamoe::kernels
