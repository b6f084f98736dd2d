// The checkpoint commands end to end through the CLI binary: inspect (text
// and --json), reload-check in both modes, load-bench, and their errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "store_support.h"

namespace megamoe {
namespace {

using test::run_cli;
using test::TempDir;

std::string make_small(const std::filesystem::path& dir, bool pow2, int layers = 2) {
  const auto r =
      run_cli(fmt::format("make-checkpoint --preset glm-5.3-flash --hidden 256 --inter 128 --experts 8 "
                          "--topk 4 --layers {} --out '{}'{}",
                          layers, dir.string(), pow2 ? " --pow2-scales" : ""));
  EXPECT_EQ(r.status, 0) << r.output;
  return dir.string();
}

// Writes `value` over float `index` of the tensor whose name ends with `suffix`, in
// whichever shard of the checkpoint folder `ck` holds it (a corrupt file on disk); returns
// the tensor's full name, empty when no shard has one.
std::string overwrite_float(const std::filesystem::path& ck, std::string_view suffix, size_t index,
                            float value) {
  for (const auto& e : std::filesystem::directory_iterator(ck)) {
    if (e.path().extension() != ".safetensors") continue;
    std::ifstream in(e.path(), std::ios::binary);
    uint64_t n = 0;
    in.read(reinterpret_cast<char*>(&n), 8);
    std::string text(n, '\0');
    in.read(text.data(), std::streamsize(n));
    in.close();
    const nlohmann::json header = nlohmann::json::parse(text);
    for (const auto& [k, v] : header.items()) {
      if (!k.ends_with(suffix)) continue;
      std::fstream f(e.path(), std::ios::binary | std::ios::in | std::ios::out);
      f.seekp(std::streamoff(8 + n + v["data_offsets"][0].get<uint64_t>() + 4 * index));
      f.write(reinterpret_cast<const char*>(&value), 4);
      return k;
    }
  }
  return "";
}

TEST(Inspect, FolderSummaryAndJson) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false);
  auto r = run_cli("inspect '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("glm5_next"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("H 256  I 128  E 8  K 4  shared 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("model.language_model.layers."), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("requantization estimate"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << "no progress bar when not a terminal";

  r = run_cli("inspect --json '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"]["family"], "glm-5.3-flash");
  EXPECT_EQ(j["model"]["hidden"], 256);
  EXPECT_EQ(j["model"]["experts"], 8);
  EXPECT_EQ(j["model"]["routing"]["router_dtype"], "f32");
  ASSERT_EQ(j["layers"].size(), 2u);
  for (const auto& l : j["layers"]) {
    EXPECT_EQ(l["tensors"], l["expected"]);
    EXPECT_TRUE(l["missing"].empty());
    EXPECT_EQ(l["shards"], 2);  // the writer splits each layer over two shards
  }
  EXPECT_LT(j["scales"]["pow2_fraction"].get<double>(), 0.05);
  EXPECT_GT(j["mxfp8_estimate"]["sampled_tensors"].get<int>(), 0);
  EXPECT_GT(j["mxfp8_estimate"]["rel_l2"].get<double>(), 1e-3);
  EXPECT_FALSE(j["mxfp8_estimate"]["exact"].get<bool>());
}

// make-checkpoint writes into a new or empty folder only: over a checkpoint of another
// layer count its shards would sit beside the old ones.
TEST(MakeCheckpointCli, RefusesAFolderThatIsNotEmpty) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 2);
  const auto r = run_cli(
      fmt::format("make-checkpoint --hidden 256 --inter 128 --experts 8 --topk 4 --layers 1 --out '{}'", ck));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the folder is not empty"), std::string::npos) << r.output;
  size_t shards = 0;
  for (const auto& e : std::filesystem::directory_iterator(ck))
    shards += e.path().extension() == ".safetensors";
  EXPECT_EQ(shards, 5u);  // 1 + 2 a layer, untouched
}

// The README's first steps: a small checkpoint, random tokens for it, one forward.
TEST(MakeInputCli, FeedsForward) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 1);
  const auto x = dir.path() / "x.safetensors", y = dir.path() / "y.safetensors";
  auto r = run_cli(fmt::format("make-input --checkpoint '{}' --tokens 5 --out '{}'", ck, x.string()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("x BF16 [5, 256]"), std::string::npos) << r.output;
  const ModelDesc d = load_config(ck);
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' --backend cpu", ck,
                          d.moe_layers.front(), x.string(), y.string()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("5 tokens on cpu"), std::string::npos) << r.output;
  r = run_cli(fmt::format("make-input --checkpoint '{}' --tokens 0 --out '{}'", ck, x.string()));
  EXPECT_NE(r.status, 0) << r.output;
  r = run_cli(fmt::format("make-input --checkpoint '{}' --out '{}'", ck, dir.path().string()));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("must name a file"), std::string::npos) << r.output;
}

TEST(Inspect, RankMemory) {
  // --ranks R: the kernel layout's bytes of a whole MoE layer and of a rank's part (E/R
  // experts with the shared expert and the router), as the layouts compute them.
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false);  // E = 8, 2 MoE layers
  auto r = run_cli("inspect --json --ranks 4 '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  const ModelDesc d = load_config(dir.path() / "ck");
  MoeShape s = d.shape;
  const size_t whole = MoeWeightLayout::compute(s).total_bytes;
  const size_t part = MoeWeightLayout::compute(s, ExpertRange{0, 2}).total_bytes;
  EXPECT_EQ(j["memory"]["layer_bytes"].get<size_t>(), whole);
  EXPECT_EQ(j["memory"]["rank_layer_bytes"].get<size_t>(), part);
  EXPECT_EQ(j["memory"]["rank_bytes"].get<size_t>(), 2 * part);
  // Six experts fewer: 3*H*I codes and their 128x128 block scales each (up to the
  // regions' 256-byte alignment).
  const size_t hb = (s.hidden + 127) / 128, ib = (s.inter + 127) / 128;
  const double per_expert = 3.0 * s.hidden * s.inter + 3.0 * double(hb * ib) * 4;
  EXPECT_NEAR(double(whole - part), 6 * per_expert, 4 * 256.0);
  r = run_cli("inspect --ranks 4 '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("4 ranks: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(2 of 8 experts"), std::string::npos) << r.output;
  // A lone file without a config beside it cannot say what a rank holds.
  const std::filesystem::path lone = dir.path() / "lone.safetensors";
  std::filesystem::copy_file(std::filesystem::path(ck) / "model-00001-of-00005.safetensors", lone);
  r = run_cli("inspect --ranks 4 '" + lone.string() + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("needs the model's config.json"), std::string::npos) << r.output;
  r = run_cli("inspect --ranks 3 '" + ck + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--ranks 3: must be >= 1 and divide E = 8"), std::string::npos) << r.output;
}

TEST(Inspect, Pow2CheckpointIsExactAndSingleFileWorks) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", true, 1);
  auto r = run_cli("inspect --json '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["scales"]["pow2_fraction"].get<double>(), 1.0);
  EXPECT_EQ(j["mxfp8_estimate"]["rel_l2"].get<double>(), 0.0);
  EXPECT_TRUE(j["mxfp8_estimate"]["exact"].get<bool>());

  // One shard, read on its own (the config beside it describes the model).
  const std::string shard = (std::filesystem::path(ck) / "model-00002-of-00003.safetensors").string();
  r = run_cli("inspect --json '" + shard + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["files"], 1);
  EXPECT_GT(j["scales"]["count"].get<int>(), 0);
  EXPECT_FALSE(j["layers"][0]["missing"].empty());  // the other half of the layer is in shard 3
}

// A NaN written over one block scale of a shard on disk: inspect reports it (and exits 1),
// the loader refuses the checkpoint naming the tensor, before it serves a forward.
TEST(Inspect, CorruptScaleIsReportedAndRefused) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 1);
  // block [1, 0] of the [2, 1] grid (H 256, I 128)
  const std::string name = overwrite_float(ck, "experts.1.down_proj.weight_scale_inv", 1, NAN);
  ASSERT_FALSE(name.empty());
  auto r = run_cli("inspect '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("CORRUPT   1 block scale is NaN, infinite, negative or too large (first: " + name +
                          " [1, 0] = nan)"),
            std::string::npos)
      << r.output;
  r = run_cli("inspect --json '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["scales"]["corrupt"], 1);
  r = run_cli(fmt::format("reload-check --checkpoint '{}' --backend cpu --tokens 2", ck));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tensor '" + name + "' holds nan at [1, 0]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the checkpoint is corrupt"), std::string::npos) << r.output;
}

// A config that disagrees with the tensors (I, then E): inspect names the first refused
// tensor per layer, counts them, and exits 1, as the loader refuses the checkpoint.
TEST(Inspect, ConfigDisagreeingWithTensorsIsReported) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 1);
  const auto cfg_path = std::filesystem::path(ck) / "config.json";
  nlohmann::json cfg;
  std::ifstream(cfg_path) >> cfg;
  auto rewrite = [&](const char* key, int value) {
    ASSERT_TRUE(cfg["text_config"].contains(key)) << key;
    cfg["text_config"][key] = value;
    std::ofstream(cfg_path, std::ios::trunc) << cfg.dump(2);
  };
  auto r = run_cli("inspect --json '" + ck + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(nlohmann::json::parse(r.output)["refused"], 0);

  rewrite("moe_intermediate_size", 256);  // the tensors hold I = 128
  r = run_cli("inspect '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(
      r.output.find("experts.0.gate_proj.weight': expected F8_E4M3 [256, 256], found F8_E4M3 [128, 256]"),
      std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("  refused 54 (first: tensor '"), std::string::npos) << r.output;  // the table
  EXPECT_NE(r.output.find("the loader refuses this checkpoint"), std::string::npos) << r.output;
  r = run_cli("inspect --json '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  auto j = nlohmann::json::parse(r.output);
  // Every routed expert's three weights and three scales, and the shared expert's.
  EXPECT_EQ(j["refused"].get<int>(), 9 * 6);
  EXPECT_EQ(j["layers"][0]["refused"].size(), j["refused"].get<size_t>());

  rewrite("moe_intermediate_size", 128);
  // A NaN in the correction bias (the router and bias are checked as the loader does).
  ASSERT_FALSE(overwrite_float(ck, "gate.e_score_correction_bias", 2, NAN).empty());
  r = run_cli("inspect '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("gate.e_score_correction_bias' holds nan at [2] (router weights and bias must be "
                          "finite)"),
            std::string::npos)
      << r.output;
  rewrite("n_routed_experts", 4);  // the checkpoint holds 8 experts; the router is [8, H]
  r = run_cli("inspect --json '" + ck + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  j = nlohmann::json::parse(r.output);
  bool unexpected = false;
  for (const auto& m : j["layers"][0]["refused"])
    unexpected |= m.get<std::string>().find("unexpected tensor") != std::string::npos &&
                  m.get<std::string>().find("experts.7.") != std::string::npos;
  EXPECT_TRUE(unexpected) << j["layers"][0]["refused"].dump(1);
}

TEST(Inspect, HostileFileIsACleanError) {
  TempDir dir;
  const auto f = dir.path() / "bad.safetensors";
  std::ofstream(f, std::ios::binary) << std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10);
  const auto r = run_cli("inspect '" + f.string() + "'");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("megamoe: error:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bad.safetensors"), std::string::npos) << r.output;
}

TEST(ReloadCheckCli, BothModesPass) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false);
  for (const char* mode : {"layerwise", "direct"}) {
    const auto r =
        run_cli(fmt::format("reload-check --checkpoint '{}' --mode {} --backend cpu --tokens 4", ck, mode));
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(fmt::format("reload-check: OK ({} mode", mode)), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("shared_w2_scale"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("DIFFER"), std::string::npos) << r.output;
  }
  const auto r = run_cli(fmt::format("reload-check --checkpoint '{}' --format mxfp8 --tokens 2", ck));
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("mx_w13_sf"), std::string::npos) << r.output;
}

TEST(ReloadCheckCli, BadArgumentsAndMissingDeviceFail) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 1);
  auto r = run_cli(fmt::format("reload-check --checkpoint '{}' --mode sideways", ck));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("sideways"), std::string::npos) << r.output;
  r = run_cli(fmt::format("reload-check --checkpoint '{}' --backend cuda", ck));
  if (r.status == 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_NE(r.output.find("--backend cuda"), std::string::npos) << r.output;
}

TEST(ReloadCheckCli, LoadBenchRuns) {
  TempDir dir;
  const std::string ck = make_small(dir.path() / "ck", false, 1);
  const auto json = dir.path() / "bench.json";
  const auto r = run_cli(fmt::format("load-bench --checkpoint '{}' --json '{}'", ck, json.string()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("ratio load / read"), std::string::npos) << r.output;
  std::ifstream in(json);
  const auto j = nlohmann::json::parse(in);
  EXPECT_GT(j["store_load_gbs"].get<double>(), 0.0);
  EXPECT_GT(j["loaded_bytes"].get<double>(), 0.0);
#ifndef __SANITIZE_ADDRESS__  // (ASan's shadow and quarantine are resident too)
  // The store's own overhead above its buffers: under a MB here. The plain read's 16 MiB
  // buffer once counted in it, so a small checkpoint read as 17 MB over (v36).
  const double extra = j["peak_extra_rss_bytes"].get<double>();
  if (extra >= 0) {  // (-1: /proc/self/clear_refs not writable)
    EXPECT_LT(extra, 8e6) << r.output;
  }
#endif
  // A JSON path it cannot write: refused before the benchmark runs.
  const auto bad = run_cli(fmt::format("load-bench --checkpoint '{}' --json '{}'", ck,
                                       (dir.path() / "no" / "such.json").string()));
  EXPECT_EQ(bad.status, 1) << bad.output;
  EXPECT_NE(bad.output.find("does not exist"), std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("ratio load / read"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace megamoe
