// Checkpoint subcommands: make-checkpoint, inspect (reload-check comes with the WeightStore).
#include <fmt/format.h>

#include <optional>
#include <string>

#include "commands.h"
#include "megamoe/io/checkpoint.h"
#include "megamoe/model/config.h"

namespace megamoe::tools {

namespace {

struct MakeArgs {
  std::string preset = "glm-4.7-flash", out;
  int layers = 1;
  bool pow2 = false;
  uint64_t seed = 1;
  int hidden = 0, inter = 0, experts = 0, topk = 0;
};

int run_make(const MakeArgs& a) {
  const Preset& p = find_preset(a.preset);
  std::optional<MoeShape> shape;
  if (a.hidden || a.inter || a.experts || a.topk) {
    MoeShape s = p.shape;
    if (a.hidden) s.hidden = a.hidden;
    if (a.inter) s.inter = a.inter;
    if (a.experts) s.experts = a.experts;
    if (a.topk) s.topk = a.topk;
    if (s.n_group > 1 && s.experts % s.n_group != 0) s.n_group = s.topk_group = 1;
    s.validate();
    shape = s;
  }
  const ModelDesc d = io::write_synthetic_checkpoint(a.out, p, a.layers, a.seed, a.pow2, shape);
  fmt::print("wrote {} ({}): {} MoE layers, {}\n", a.out, d.family, d.moe_layers.size(), d.shape.describe());
  return 0;
}

int run_inspect(const std::string& path) {
  const ModelDesc d = load_config(path);
  fmt::print("model_type {} (family {}): {}\n", d.model_type, d.family, d.shape.describe());
  fmt::print("layers {}, MoE layers {}\n", d.num_layers, d.moe_layers.size());
  const io::Checkpoint ckpt(path);
  fmt::print("{} shards, {} tensors\n", ckpt.num_files(), ckpt.names().size());
  return 0;
}

}  // namespace

std::vector<Command> add_checkpoint_commands(CLI::App& app) {
  std::vector<Command> cmds;
  auto mk = std::make_shared<MakeArgs>();
  auto* c_make = app.add_subcommand("make-checkpoint", "Write a synthetic HF-layout block-FP8 checkpoint");
  c_make->add_option("--preset", mk->preset)->capture_default_str();
  c_make->add_option("--layers", mk->layers, "MoE layers to write")->capture_default_str();
  c_make->add_option("--out", mk->out, "output directory")->required();
  c_make->add_flag("--pow2-scales", mk->pow2, "round every block scale to a power of two");
  c_make->add_option("--seed", mk->seed)->capture_default_str();
  c_make->add_option("--hidden", mk->hidden, "override H (small test checkpoints)");
  c_make->add_option("--inter", mk->inter, "override I");
  c_make->add_option("--experts", mk->experts, "override E");
  c_make->add_option("--topk", mk->topk, "override K");
  cmds.push_back({c_make, [mk] { return run_make(*mk); }});

  auto path = std::make_shared<std::string>();
  auto* c_inspect = app.add_subcommand("inspect", "Summarize a checkpoint directory");
  c_inspect->add_option("path", *path, "checkpoint directory")->required();
  cmds.push_back({c_inspect, [path] { return run_inspect(*path); }});
  return cmds;
}

}  // namespace megamoe::tools
