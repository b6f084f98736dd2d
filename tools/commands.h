// Subcommand groups of the `megamoe` tool, each in its own file.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <stdexcept>
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

// A preset's shape with the overrides that are given (0: the preset's value), validated. The
// preset's expert groups go where the overridden E cannot hold them (no groups then).
inline MoeShape with_shape_overrides(MoeShape s, int hidden, int inter, int experts, int topk) {
  if (hidden) s.hidden = hidden;
  if (inter) s.inter = inter;
  if (experts) s.experts = experts;
  if (topk) s.topk = topk;
  if (s.n_group > 1 && (s.experts % s.n_group != 0 || s.experts / s.n_group < 2))
    s.n_group = s.topk_group = 1;
  s.validate();
  return s;
}

// The check of a --seed (an unsigned 64-bit value): CLI11 would take "-1" modulo 2^64, a
// silently different seed.
inline CLI::Validator seed_check() {
  return CLI::Validator(
      [](const std::string& v) {
        return v.find_first_not_of("0123456789") == std::string::npos && !v.empty()
                   ? std::string()
                   : "a seed is a non-negative integer, not '" + v + "'";
      },
      "UINT64");
}

// An output file's path, checked before the work that fills it: a file name (not a folder,
// not empty) in a folder that exists.
inline void check_output_file(std::string_view option, const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty() || fs::is_directory(path))
    throw std::invalid_argument(fmt::format("{} '{}': must name a file", option, path));
  if (const auto dir = fs::path(path).parent_path(); !dir.empty() && !fs::is_directory(dir))
    throw std::invalid_argument(
        fmt::format("{} {}: the folder {} does not exist", option, path, dir.string()));
}

// inspect, make-checkpoint, reload-check (tools/checkpoint_commands.cpp).
std::vector<Command> add_checkpoint_commands(CLI::App& app);

// soak: the randomized differential run against the CPU reference (tools/soak.cpp).
std::vector<Command> add_soak_commands(CLI::App& app);

}  // namespace megamoe::tools
