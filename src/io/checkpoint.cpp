// The checkpoint folder's config.json and index writers (see checkpoint.h).
#include "megamoe/io/checkpoint.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace megamoe::io {

namespace {

void write_text(const std::filesystem::path& path, const std::string& text) {
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    if (!out) throw Error(fmt::format("{}: write failed", tmp.string()));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw Error(fmt::format("{}: rename failed: {}", path.string(), ec.message()));
}

}  // namespace

void write_config(const std::filesystem::path& dir, const ModelDesc& d) {
  write_text(dir / "config.json", config_json(d));
}

void write_index(const std::filesystem::path& dir, const std::map<std::string, std::string>& weight_map,
                 uint64_t total_size) {
  nlohmann::ordered_json j;
  j["metadata"] = {{"total_size", total_size}};
  j["weight_map"] = weight_map;
  write_text(dir / "model.safetensors.index.json", j.dump(2) + "\n");
}

}  // namespace megamoe::io
