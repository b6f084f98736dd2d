// `megamoe bench`'s host side: the skewed-routing generator (--routing zipf:S), the
// option checks, the results path, and the layout of a case's JSON record.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <vector>

#include "megamoe_bench/bench.h"
#include "megamoe_bench/routing_gen.h"

namespace megamoe::api {
namespace {

MoeShape glm5_like() {
  MoeShape s = find_preset("glm-5").shape;
  s.validate();
  return s;
}

// The busiest expert's rows over the mean rows an expert.
double hot_ratio(const GeneratedRouting& g, int E, int T, int K) {
  std::vector<int> rows(E, 0);
  for (int32_t id : g.ids) ++rows[id];
  return *std::max_element(rows.begin(), rows.end()) / (double(T) * K / E);
}

TEST(BenchRouting, ParsesUniformAndZipf) {
  EXPECT_EQ(parse_routing("uniform").kind, RoutingSpec::Kind::kUniform);
  const RoutingSpec z = parse_routing("zipf:1.0");
  EXPECT_EQ(z.kind, RoutingSpec::Kind::kZipf);
  EXPECT_EQ(z.zipf_s, 1.0);
  EXPECT_EQ(z.text(), "zipf:1");
  EXPECT_EQ(parse_routing("zipf:0").zipf_s, 0.0);
  EXPECT_EQ(parse_routing("zipf:1.25").text(), "zipf:1.25");
  for (const char* bad :
       {"", "zipf", "zipf:", "zipf:-1", "zipf:abc", "zipf:1x", "zipf:nan", "zipf:inf", "Uniform", "skewed"}) {
    try {
      parse_routing(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("--routing"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
    }
  }
}

TEST(BenchRouting, ZipfIdsDistinctInRangeWeightsNormalized) {
  const MoeShape s = glm5_like();
  for (double S : {0.0, 1.0, 3.0, 8.0}) {
    const int T = 777;
    const GeneratedRouting g = zipf_routing(s, T, S, 11);
    ASSERT_EQ(g.ids.size(), size_t(T) * s.topk);
    ASSERT_EQ(g.weights.size(), g.ids.size());
    for (int t = 0; t < T; ++t) {
      std::set<int> seen;
      double sum = 0;
      for (int k = 0; k < s.topk; ++k) {
        const int32_t id = g.ids[size_t(t) * s.topk + k];
        const float w = g.weights[size_t(t) * s.topk + k];
        ASSERT_GE(id, 0);
        ASSERT_LT(id, s.experts);
        ASSERT_TRUE(seen.insert(id).second) << "S " << S << " token " << t << " repeats expert " << id;
        ASSERT_TRUE(std::isfinite(w) && w > 0) << w;
        sum += w;
      }
      const double want = s.norm_topk_prob ? double(s.routed_scaling) : sum;
      ASSERT_NEAR(sum, want, 1e-5 * want);
    }
  }
}

// Without norm_topk_prob each weight is its raw draw in [0.05, 1] times routed_scaling.
TEST(BenchRouting, ZipfWeightsUnnormalized) {
  MoeShape s = glm5_like();
  s.norm_topk_prob = false;
  const GeneratedRouting g = zipf_routing(s, 300, 1.0, 5);
  double sum = 0;
  for (float w : g.weights) {
    ASSERT_GE(w, 0.05f * s.routed_scaling * (1 - 1e-6f)) << w;
    ASSERT_LE(w, 1.0f * s.routed_scaling * (1 + 1e-6f)) << w;
    sum += w;
  }
  // the mean of 0.05 + 0.95 U is 0.525: far from a per-token sum of routed_scaling
  EXPECT_NEAR(sum / g.weights.size(), 0.525 * s.routed_scaling, 0.05 * s.routed_scaling);
}

TEST(BenchRouting, ZipfDeterministicInTheSeed) {
  const MoeShape s = glm5_like();
  const GeneratedRouting a = zipf_routing(s, 300, 1.0, 7), b = zipf_routing(s, 300, 1.0, 7);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.weights, b.weights);
  const GeneratedRouting c = zipf_routing(s, 300, 1.0, 8);
  EXPECT_NE(a.ids, c.ids);
  // The same seed gives the same popularity order whatever T: T tokens are the first T
  // of a longer run.
  const GeneratedRouting d = zipf_routing(s, 100, 1.0, 7);
  EXPECT_TRUE(std::equal(d.ids.begin(), d.ids.end(), a.ids.begin()));
}

TEST(BenchRouting, HottestExpertGrowsWithTheExponent) {
  const MoeShape s = glm5_like();  // 256 experts, top-8
  const int T = 16384;
  double prev = 0;
  for (double S : {0.0, 0.5, 1.0, 1.5}) {
    const double r = hot_ratio(zipf_routing(s, T, S, 3), s.experts, T, s.topk);
    EXPECT_GT(r, prev) << "S " << S;
    prev = r;
    if (S == 0.0) {
      EXPECT_LT(r, 1.25) << "S = 0 is uniform";  // (the largest of 256 binomial counts of mean 512)
    }
    if (S == 1.0) {
      EXPECT_GT(r, 4.0) << "zipf:1 has hot experts several times the mean";
    }
  }
  // The hot experts are a random set, not the low ids.
  const GeneratedRouting g = zipf_routing(s, T, 1.0, 3);
  std::vector<int> rows(s.experts, 0);
  for (int32_t id : g.ids) ++rows[id];
  EXPECT_NE(std::max_element(rows.begin(), rows.end()) - rows.begin(), 0);
}

TEST(BenchRouting, ZipfRejectsBadArguments) {
  MoeShape s = glm5_like();
  EXPECT_THROW(zipf_routing(s, -1, 1.0, 1), std::invalid_argument);
  EXPECT_THROW(zipf_routing(s, 4, -0.5, 1), std::invalid_argument);
  EXPECT_THROW(zipf_routing(s, 4, NAN, 1), std::invalid_argument);
  s.topk = s.experts + 1;
  EXPECT_THROW(zipf_routing(s, 4, 1.0, 1), std::invalid_argument);
  EXPECT_TRUE(zipf_routing(glm5_like(), 0, 1.0, 1).ids.empty());
}

TEST(BenchOptionsTest, ResultsPathFromTheCard) {
  EXPECT_EQ(bench_results_path("NVIDIA H100 80GB HBM3"), "bench/results/h100.json");
  EXPECT_EQ(bench_results_path("NVIDIA H100 PCIe"), "bench/results/h100.json");
  EXPECT_EQ(bench_results_path("NVIDIA H200"), "bench/results/h200.json");
  EXPECT_EQ(bench_results_path("NVIDIA H200 NVL"), "bench/results/h200.json");
  for (const char* other : {"NVIDIA A100-SXM4-80GB", "NVIDIA B200", "NVIDIA H1000", ""}) {
    try {
      bench_results_path(other);
      ADD_FAILURE() << "accepted '" << other << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + other + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(BenchOptionsTest, ValidatesRoutingsRegimesAndWindows) {
  BenchOptions o;
  EXPECT_NO_THROW(validate_bench_options(o));
  o.routings = {"uniform", "zipf:1.0"};
  EXPECT_NO_THROW(validate_bench_options(o));
  make_quick(o);
  EXPECT_NO_THROW(validate_bench_options(o));
  EXPECT_LT(o.sustained_seconds, 1.0);
  auto bad = [](auto edit, const char* what) {
    BenchOptions b;
    edit(b);
    try {
      validate_bench_options(b);
      ADD_FAILURE() << "accepted " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  bad([](BenchOptions& b) { b.routings = {"zipf:x"}; }, "--routing");
  bad([](BenchOptions& b) { b.routings.clear(); }, "--routing");
  bad([](BenchOptions& b) { b.regimes = {"steady"}; }, "--regime");
  bad([](BenchOptions& b) { b.sustained_seconds = 0; }, "sustained window");
  bad([](BenchOptions& b) { b.dense_m = 1000; }, "--dense-m");
  bad([](BenchOptions& b) { b.burst_gap_ms = -1; }, "--burst-gap-ms");
}

BenchCaseFigures sample_figures() {
  BenchCaseFigures f;
  f.preset = "glm-5";
  f.shape = "H=6144 I=2048";
  f.routing = "zipf:1";
  f.regime = "sustained";
  f.config = "cfg";
  f.baseline_timing = "graph";
  f.tokens = 4096;
  f.local_experts = 256;
  f.experts_hit = 200;
  f.hot_expert_rows = 6.5;
  f.weight_bytes = 8e9;
  f.flops = 2.5e12;
  f.read_bw = 3.0e12;
  f.dense_tflops = 1100;
  f.us = 3000;
  f.us_p10 = 2990;
  f.us_p90 = 3010;
  f.route_us = 150;
  f.baseline_us = 6000;
  f.sm_clock_mhz = 1410;
  f.power_w = 699;
  f.calls = 300;
  return f;
}

TEST(BenchRecord, FieldsAndFloors) {
  BenchCaseFigures f = sample_figures();
  const nlohmann::json c = bench_case_record(f);
  for (const char* k : {"preset",
                        "shape",
                        "tokens",
                        "local_experts",
                        "ep_share",
                        "routing",
                        "regime",
                        "us",
                        "us_p10",
                        "us_p90",
                        "calls",
                        "route_us",
                        "after_routing_us",
                        "tflops",
                        "dense_tflops",
                        "dense_fraction",
                        "floor_us",
                        "hbm_floor_us",
                        "tc_floor_us",
                        "ratio_to_floor",
                        "experts_hit",
                        "hot_expert_rows",
                        "weight_bytes",
                        "weight_TBps",
                        "sm_clock_mhz",
                        "power_w",
                        "baseline_us",
                        "baseline_timing",
                        "speedup_vs_baseline",
                        "nonfinite_outputs",
                        "config"})
    EXPECT_TRUE(c.contains(k)) << k;
  EXPECT_EQ(c["regime"], "sustained");
  EXPECT_EQ(c["routing"], "zipf:1");
  const double tflops = 2.5e12 / 3000e-6 * 1e-12;  // 833.3
  EXPECT_NEAR(c["tflops"].get<double>(), tflops, 1e-9 * tflops);
  EXPECT_NEAR(c["dense_fraction"].get<double>(), tflops / 1100, 1e-12);
  const double read_floor = 8e9 / 3e12 * 1e6, tc_floor = 2.5e12 / 1100e12 * 1e6;  // 2666.7, 2272.7
  EXPECT_NEAR(c["hbm_floor_us"].get<double>(), read_floor, 1e-6);
  EXPECT_NEAR(c["tc_floor_us"].get<double>(), tc_floor, 1e-6);
  EXPECT_NEAR(c["floor_us"].get<double>(), read_floor, 1e-6);  // the larger
  EXPECT_NEAR(c["ratio_to_floor"].get<double>(), 3000 / read_floor, 1e-9);
  EXPECT_NEAR(c["speedup_vs_baseline"].get<double>(), 2.0, 1e-12);
  EXPECT_NEAR(c["after_routing_us"].get<double>(), 2850, 1e-9);
  // A slower dense rate: the compute floor is the larger one.
  f.dense_tflops = 800;
  EXPECT_NEAR(bench_case_record(f)["floor_us"].get<double>(), 2.5e12 / 800e12 * 1e6, 1e-6);
  // No baseline: -1 and a zero speedup, no timing field.
  f.baseline_us = -1;
  f.baseline_timing.clear();
  const nlohmann::json nb = bench_case_record(f);
  EXPECT_EQ(nb["speedup_vs_baseline"].get<double>(), 0.0);
  EXPECT_FALSE(nb.contains("baseline_timing"));
  EXPECT_NE(bench_case_line(f).find("of dense"), std::string::npos);
}

TEST(BenchRecord, RejectsBadFigures) {
  BenchCaseFigures f = sample_figures();
  f.regime = "both";
  EXPECT_THROW(bench_case_record(f), std::invalid_argument);
  f = sample_figures();
  f.us = 0;
  EXPECT_THROW(bench_case_record(f), std::invalid_argument);
  f = sample_figures();
  f.dense_tflops = NAN;
  EXPECT_THROW(bench_case_record(f), std::invalid_argument);
  f = sample_figures();
  f.read_bw = 0;
  EXPECT_THROW(bench_case_line(f), std::invalid_argument);
}

}  // namespace
}  // namespace megamoe::api
