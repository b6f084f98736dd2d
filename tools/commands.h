// Subcommand groups of the `megamoe` tool, each in its own file.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "megamoe/model/shape.h"

namespace megamoe::tools {

struct Command {
  CLI::App* app;             // the subcommand (selected when *app is true after parsing)
  std::function<int()> run;  // runs it; returns the exit code, throws on error
};

// The check of a shape override (--hidden, --inter, --experts, --topk): 0 is no override
// but a mistake, so the option refuses it rather than leaving the preset's value.
inline CLI::Range shape_override_range() { return CLI::Range(1, 1 << 20); }

// The presets' names, for a --preset option's help ("glm-5.3-flash | glm-5 | ...").
inline std::string preset_names() {
  std::string out;
  for (const Preset& p : presets()) out += (out.empty() ? "" : " | ") + p.name;
  return out;
}

// inspect, make-checkpoint, reload-check (tools/checkpoint_commands.cpp).
std::vector<Command> add_checkpoint_commands(CLI::App& app);

}  // namespace megamoe::tools
