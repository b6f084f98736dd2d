// `megamoe forward` end to end through the CLI binary on a checkpoint the test
// writes itself: outputs equal the reference computed in-process from the same
// checkpoint, expert-parallel ranks give the same bytes, and errors are clear.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "megamoe/api/forward.h"
#include "megamoe/io/safetensors.h"
#include "megamoe/reference/moe.h"
#include "megamoe/weights/checkpoint_layout.h"
#include "store_support.h"
#include "support.h"

namespace megamoe {
namespace {

using test::run_cli;

struct ForwardFixture {
  test::TempDir dir;
  std::string ck, in;
  ModelDesc desc;
  int layer = 0;
  int T = 13;
  std::vector<num::bf16_t> x;

  ForwardFixture() {
    ck = (dir.path() / "ck").string();
    desc = test::write_test_checkpoint(ck, 2, 77);
    layer = desc.moe_layers.back();
    x = test::random_bf16(size_t(T) * desc.shape.hidden, 5);
    in = write_x("x.safetensors", T, desc.shape.hidden, x);
  }
  std::string out(const std::string& name) const { return (dir.path() / name).string(); }
  // A forward input: one BF16 tensor "x" of [rows, cols] in the file `name` of the folder.
  std::string write_x(const std::string& name, int64_t rows, int64_t cols,
                      const std::vector<num::bf16_t>& v) const {
    const io::TensorToWrite t{"x", io::Dtype::kBF16, {rows, cols}, v.data(), v.size() * 2};
    const std::string path = out(name);
    io::write_safetensors(path, std::span<const io::TensorToWrite>(&t, 1));
    return path;
  }
};

TEST(CliForward, MatchesInProcessReferenceAndRanks) {
  ForwardFixture f;
  const MoeShape& s = f.desc.shape;
  for (int ranks : {1, 2, 4}) {
    const std::string o = f.out(fmt::format("y{}.safetensors", ranks));
    const auto r =
        run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' "
                            "--backend cpu --ranks {}",
                            f.ck, f.layer, f.in, o, ranks));
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // The reference, in-process, from the same checkpoint.
  const io::Checkpoint ckpt(f.ck);
  const HostMoeWeights w = load_moe_layer(ckpt, f.desc, f.layer);
  std::vector<int32_t> ids(size_t(f.T) * s.topk);
  std::vector<float> wts(ids.size()), y(size_t(f.T) * s.hidden);
  ref::route(s, w.view(), f.x.data(), f.T, ids.data(), wts.data());
  ref::moe_layer(s, w.view(), f.x.data(), f.T, ids.data(), wts.data(), ref::Mode::kKernelFaithful, y.data());
  std::vector<num::bf16_t> yb(y.size());
  for (size_t i = 0; i < y.size(); ++i) yb[i] = num::bf16_encode(y[i]);

  for (int ranks : {1, 2, 4}) {
    const io::SafetensorsFile out(f.out(fmt::format("y{}.safetensors", ranks)));
    const io::TensorView yv = out.at("y"), iv = out.at("topk_ids"), wv = out.at("topk_weights");
    ASSERT_EQ(yv.dtype, io::Dtype::kBF16);
    ASSERT_EQ(yv.bytes, yb.size() * 2);
    EXPECT_EQ(0, std::memcmp(yv.data, yb.data(), yv.bytes)) << "y differs at ranks " << ranks;
    ASSERT_EQ(iv.bytes, ids.size() * 4);
    EXPECT_EQ(0, std::memcmp(iv.data, ids.data(), iv.bytes)) << "ids differ at ranks " << ranks;
    ASSERT_EQ(wv.bytes, wts.size() * 4);
    EXPECT_EQ(0, std::memcmp(wv.data, wts.data(), wv.bytes)) << "weights differ at ranks " << ranks;
  }
}

// A non-finite token is not an error (api/moe_layer.h): it changes only its own output row.
TEST(CliForward, NonFiniteTokenChangesOnlyItsRow) {
  ForwardFixture f;
  const int64_t H = f.desc.shape.hidden;
  const std::string clean = f.out("clean.safetensors"), dirty = f.out("dirty.safetensors");
  auto r =
      run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' --backend cpu",
                          f.ck, f.layer, f.in, clean));
  ASSERT_EQ(r.status, 0) << r.output;
  std::vector<num::bf16_t> bad_x = f.x;
  bad_x[size_t(2) * H + 5] = num::bf16_encode(NAN);
  bad_x[size_t(7) * H + 1] = num::bf16_encode(INFINITY);
  const std::string badin = f.write_x("nan.safetensors", f.T, H, bad_x);
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' --backend cpu",
                          f.ck, f.layer, badin, dirty));
  ASSERT_EQ(r.status, 0) << r.output;
  const io::SafetensorsFile a(clean), b(dirty);
  const io::TensorView ya = a.at("y"), yb = b.at("y");
  ASSERT_EQ(ya.bytes, yb.bytes);
  const size_t row = size_t(H) * 2;
  for (int t = 0; t < f.T; ++t) {
    const bool same = std::memcmp(ya.data + t * row, yb.data + t * row, row) == 0;
    if (t == 2 || t == 7)
      EXPECT_FALSE(same) << "token " << t << " (non-finite) kept its clean row";
    else
      EXPECT_TRUE(same) << "token " << t << " changed with another token's non-finite input";
  }
}

TEST(CliForward, ErrorsNameWhatIsWrong) {
  ForwardFixture f;
  const std::string o = f.out("y.safetensors");
  auto r =
      run_cli(fmt::format("forward --checkpoint '{}' --layer 0 --input '{}' --output '{}'", f.ck, f.in, o));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("not an MoE layer"), std::string::npos) << r.output;

  // An input whose width is not H.
  const std::string badin = f.write_x("bad.safetensors", 3, 7, std::vector<num::bf16_t>(3 * 7));
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}'", f.ck, f.layer,
                          badin, o));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("'x' must be BF16"), std::string::npos) << r.output;

  r = run_cli(fmt::format("forward --checkpoint '{}' --layer 1 --input '{}' --output '{}'", f.out("missing"),
                          f.in, o));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("missing"), std::string::npos) << r.output;

  // An output folder that does not exist: refused before the checkpoint is loaded.
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}'", f.ck, f.layer,
                          f.in, f.out("no/such/folder/y.safetensors")));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;

  // An output path that is a folder, or the input itself: refused before the forward.
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}'", f.ck, f.layer,
                          f.in, f.dir.path().string()));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("must name a file"), std::string::npos) << r.output;
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}'", f.ck, f.layer,
                          f.in, f.in));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("is the --input file"), std::string::npos) << r.output;

  // Ranks: at least 1 (the parser), and a divisor of E, named before anything is loaded.
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' --ranks 0", f.ck,
                          f.layer, f.in, o));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--ranks"), std::string::npos) << r.output;
  r = run_cli(fmt::format("forward --checkpoint '{}' --layer {} --input '{}' --output '{}' --ranks 3", f.ck,
                          f.layer, f.out("missing.safetensors"), o));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find(fmt::format("--ranks 3: must divide E = {}", f.desc.shape.experts)),
            std::string::npos)
      << r.output;

  r = run_cli("forward --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.output.find("--checkpoint"), std::string::npos);
}

TEST(CliDemo, CudaWithoutDeviceFailsFirst) {
  // An explicit --backend cuda on a machine without a usable GPU: the error, at once (before
  // the demo spends seconds making a 7 GB layer, or forward loads a checkpoint).
  std::string why;
  if (api::cuda_available(&why)) GTEST_SKIP() << "a CUDA device is present";
  for (const char* cmd : {"demo --backend cuda --preset glm-5",
                          "forward --backend cuda --checkpoint /nonexistent "
                          "--layer 3 --input a --output b"}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = run_cli(cmd);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.status, 0) << cmd;
    EXPECT_NE(r.output.find("CUDA backend requested but unavailable: " + why), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("random block-FP8 layer"), std::string::npos) << r.output;
    EXPECT_LT(s, 5.0) << cmd;
  }
}

TEST(Cli, VersionNamesTheReleaseAndTheBuild) {
  // "megamoe 0.1.0 (commit abc1234)": CMake's project version, then the commit the binary was
  // built from (cmake/git_commit.cmake), as megamoe bench's JSON records it: seven hex digits
  // (and "+uncommitted" for a dirty tree), or "unknown" outside git.
  const auto r = run_cli("--version");
  EXPECT_EQ(r.status, 0) << r.output;
  // (no std::regex: GCC 12 warns inside it under the sanitizers' build)
  std::string id = r.output.substr(0, r.output.find('\n') + 1);  // (the runtime's lines follow)
  const std::string head = std::string("megamoe ") + MEGAMOE_VERSION + " (commit ";
  const bool framed = id.starts_with(head) && id.ends_with(")\n");
  if (framed) id = id.substr(head.size(), id.size() - head.size() - 2);
  if (id.ends_with("+uncommitted")) id.resize(id.size() - 12);
  const bool hex7 = id.size() == 7 && id.find_first_not_of("0123456789abcdef") == std::string::npos;
  EXPECT_TRUE(framed && (hex7 || id == "unknown")) << r.output;
  EXPECT_EQ(std::string(MEGAMOE_VERSION).find_first_not_of("0123456789."), std::string::npos)
      << MEGAMOE_VERSION;
}

TEST(Cli, NegativeSeedIsAnError) {
  // The seeds are unsigned: a negative one was taken modulo 2^64 (a silently different seed).
  for (const char* cmd : {"demo --backend cpu --seed -1", "make-input --checkpoint . --out x --seed -1",
                          "make-checkpoint --out x --seed -1", "reload-check --checkpoint . --seed -1"}) {
    const auto r = run_cli(cmd);
    EXPECT_EQ(r.status, 1) << cmd << ": " << r.output;
    EXPECT_NE(r.output.find("megamoe: error:"), std::string::npos) << cmd << ": " << r.output;
    EXPECT_NE(r.output.find("--seed"), std::string::npos) << cmd << ": " << r.output;
  }
}

TEST(CliDemo, CpuBackendChecksItself) {
  // The first command a new user runs, end to end on the CPU backend: its float64 check
  // and its report. (The bitwise check against the kernel-faithful reference holds by
  // construction here, the CPU backend being that reference; on a GPU it checks the
  // kernel, as the GPU tests do.)
  const auto r = run_cli("demo --backend cpu --preset glm-4.7-flash --tokens 4 --check-tokens 2");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("equal to the kernel-faithful reference's bits"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("demo: OK"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace megamoe
