// Safetensors parsing, mapping and writing; Checkpoint directories (see safetensors.h).
#include "megamoe/io/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

namespace megamoe::io {

namespace {

using json = nlohmann::json;

struct DtypeName {
  Dtype dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DtypeName, 15> kDtypes = {{
    {Dtype::kBool, "BOOL", 1},
    {Dtype::kU8, "U8", 1},
    {Dtype::kI8, "I8", 1},
    {Dtype::kF8_E4M3, "F8_E4M3", 1},
    {Dtype::kF8_E5M2, "F8_E5M2", 1},
    {Dtype::kI16, "I16", 2},
    {Dtype::kU16, "U16", 2},
    {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2},
    {Dtype::kI32, "I32", 4},
    {Dtype::kU32, "U32", 4},
    {Dtype::kF32, "F32", 4},
    {Dtype::kI64, "I64", 8},
    {Dtype::kU64, "U64", 8},
    {Dtype::kF64, "F64", 8},
}};

const DtypeName& dtype_entry(Dtype d) {
  for (const auto& e : kDtypes)
    if (e.dtype == d) return e;
  throw std::logic_error("dtype missing from kDtypes");
}

std::string json_type(const json& j) { return j.type_name(); }

// The JSON-level checks that nlohmann's DOM would otherwise lose: nesting depth
// (checked as each container opens, before the parser goes deeper) and
// duplicate keys (the DOM keeps the last one silently; for tensor names that
// would hide a second definition of the same tensor).
class GuardedParse {
 public:
  explicit GuardedParse(std::string_view file) : file_(file) {}

  bool operator()(int depth, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        // `depth` is the depth of the container being opened minus one.
        if (depth + 1 > kMaxJsonDepth)
          throw FormatError(fmt::format("{}: safetensors header nests deeper than {} levels (found depth {})",
                                        file_, kMaxJsonDepth, depth + 1));
        if (ev == json::parse_event_t::object_start) keys_.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys_.empty()) keys_.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys_.empty() && parsed.is_string()) {
          const auto& k = parsed.get_ref<const std::string&>();
          if (!keys_.back().insert(k).second)
            throw FormatError(fmt::format("{}: duplicate key '{}' in safetensors header{}", file_, k,
                                          keys_.size() == 1 ? " (a tensor defined twice)" : ""));
        }
        break;
      default: break;
    }
    return true;
  }

 private:
  std::string_view file_;
  std::vector<std::set<std::string>> keys_;
};

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON integer as uint64 when it is one (nlohmann keeps negative integers
// signed and large ones unsigned; floats and other types are not integers).
std::optional<uint64_t> as_u64(const json& j) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  return std::nullopt;
}

TensorInfo parse_entry(const std::string& name, const json& e, std::string_view file, uint64_t data_bytes) {
  auto fail = [&](const std::string& what) {
    throw FormatError(fmt::format("{}: tensor '{}': {}", file, name, what));
  };
  if (!e.is_object()) fail(fmt::format("entry must be a JSON object, found {}", json_type(e)));
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!e.contains(key)) fail(fmt::format("entry is missing '{}'", key));

  TensorInfo t;
  t.name = name;
  const json& jd = e["dtype"];
  if (!jd.is_string()) fail(fmt::format("dtype must be a string, found {}", json_type(jd)));
  const auto dt = parse_dtype(jd.get_ref<const std::string&>());
  if (!dt) fail(fmt::format("unknown dtype '{}'", jd.get_ref<const std::string&>()));
  t.dtype = *dt;

  const json& js = e["shape"];
  if (!js.is_array()) fail(fmt::format("shape must be an array, found {}", json_type(js)));
  uint64_t numel = 1;
  for (size_t i = 0; i < js.size(); ++i) {
    const json& d = js[i];
    if (d.is_number_integer() && !d.is_number_unsigned())
      fail(fmt::format("shape[{}] = {} is negative", i, d.get<int64_t>()));
    const auto v = as_u64(d);
    if (!v) fail(fmt::format("shape[{}] must be a non-negative integer, found {}", i, json_type(d)));
    if (*v > uint64_t(INT64_MAX)) fail(fmt::format("shape[{}] = {} does not fit in int64", i, *v));
    if (__builtin_mul_overflow(numel, *v, &numel))
      fail(fmt::format("shape {} has an element count that overflows 64 bits", js.dump()));
    t.shape.push_back(int64_t(*v));
  }
  uint64_t expect_bytes = 0;
  if (__builtin_mul_overflow(numel, uint64_t(dtype_size(t.dtype)), &expect_bytes))
    fail(fmt::format("shape {} of {} has a byte size that overflows 64 bits", format_shape(t.shape),
                     to_string(t.dtype)));

  const json& jo = e["data_offsets"];
  if (!jo.is_array() || jo.size() != 2)
    fail(fmt::format("data_offsets must be an array [begin, end], found {}", jo.dump()));
  const auto b = as_u64(jo[0]), en = as_u64(jo[1]);
  if (!b || !en) fail(fmt::format("data_offsets must be non-negative integers, found {}", jo.dump()));
  t.begin = *b;
  t.end = *en;
  if (t.begin > t.end) fail(fmt::format("data_offsets reversed: begin {} > end {}", t.begin, t.end));
  if (t.end > data_bytes)
    fail(fmt::format("data_offsets [{}, {}) outside the data section of {} bytes", t.begin, t.end,
                     data_bytes));
  if (t.end - t.begin != expect_bytes)
    fail(fmt::format("byte size {} from data_offsets != {} expected for {} {} ({} elements x {} bytes)",
                     t.end - t.begin, expect_bytes, to_string(t.dtype), format_shape(t.shape), numel,
                     dtype_size(t.dtype)));
  return t;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::string_view to_string(Dtype d) { return dtype_entry(d).name; }

std::optional<Dtype> parse_dtype(std::string_view s) {
  for (const auto& e : kDtypes)
    if (e.name == s) return e.dtype;
  return std::nullopt;
}

size_t dtype_size(Dtype d) { return dtype_entry(d).size; }

std::string format_shape(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

const TensorInfo* Header::find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

namespace {

// A file that is not safetensors at all fails the length checks with a meaningless
// length; when it starts like JSON (a config.json or index handed where a shard goes),
// say so.
std::string not_safetensors_hint(const uint8_t* data, size_t size) {
  size_t i = 0;
  while (i < size && i < 8 && (data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t')) ++i;
  if (i < size && (data[i] == '{' || data[i] == '['))
    return " (the file starts like JSON text, not a safetensors file: a checkpoint is the folder holding "
           "config.json and the .safetensors shards)";
  return {};
}

}  // namespace

Header parse_header(const uint8_t* data, size_t size, std::string_view file) {
  if (size < 8)
    throw FormatError(fmt::format("{}: file is {} bytes, shorter than the 8-byte header length", file, size));
  const uint64_t n = read_le64(data);
  if (n > kMaxHeaderBytes)
    throw FormatError(fmt::format("{}: header length {} exceeds the {} byte limit{}", file, n,
                                  kMaxHeaderBytes, not_safetensors_hint(data, size)));
  if (n > size - 8)
    throw FormatError(fmt::format("{}: header length {} exceeds the {} bytes after the length field{}", file,
                                  n, size - 8, not_safetensors_hint(data, size)));

  Header h;
  h.data_offset = 8 + n;
  const uint64_t data_bytes = size - h.data_offset;
  const char* text = reinterpret_cast<const char*>(data + 8);

  json root;
  try {
    root = json::parse(text, text + n, GuardedParse(file));
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: header is not valid JSON: {}", file, e.what()));
  }
  if (!root.is_object())
    throw FormatError(fmt::format("{}: header must be a JSON object, found {}", file, json_type(root)));

  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        throw FormatError(
            fmt::format("{}: __metadata__ must be an object, found {}", file, json_type(entry)));
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string())
          throw FormatError(
              fmt::format("{}: __metadata__['{}'] must be a string, found {}", file, k, json_type(v)));
        h.metadata.emplace(k, v.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(name, entry, file, data_bytes));
  }

  // Overlap check on the byte ranges sorted by start. Empty tensors occupy no
  // bytes and cannot overlap anything. Gaps are allowed (writers may align).
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : h.tensors)
    if (t.bytes() > 0) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    const TensorInfo& b = *by_offset[i];
    if (b.begin < a.end)
      throw FormatError(fmt::format("{}: tensor '{}' bytes [{}, {}) overlap tensor '{}' bytes [{}, {})", file,
                                    b.name, b.begin, b.end, a.name, a.begin, a.end));
  }
  // nlohmann objects iterate in key order, so the tensors are already sorted
  // by name; sort anyway so Header::find never depends on that detail.
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  return h;
}

// ---- SafetensorsFile ----

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path.string()) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw NotFoundError(fmt::format("{}: no such file", path_));
    throw Error(fmt::format("{}: cannot open: {}", path_, errno_text()));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    throw Error(fmt::format("{}: cannot stat: {}", path_, why));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file", path_));
  }
  size_ = size_t(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    // parse_header words this error; mmap of an empty file would fail first.
    static const uint8_t kEmpty[8] = {};
    parse_header(kEmpty, size_, path_);
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string why = p == MAP_FAILED ? errno_text() : "";
  ::close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) throw Error(fmt::format("{}: mmap of {} bytes failed: {}", path_, size_, why));
  map_ = static_cast<const uint8_t*>(p);
  try {
    header_ = parse_header(map_, size_, path_);
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      header_(std::move(o.header_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    header_ = std::move(o.header_);
  }
  return *this;
}

void SafetensorsFile::unmap() noexcept {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), size_);
  map_ = nullptr;
  size_ = 0;
}

TensorView SafetensorsFile::view(const TensorInfo& t) const {
  return TensorView{t.name, path_, t.dtype, t.shape, map_ + header_.data_offset + t.begin, size_t(t.bytes())};
}

std::optional<TensorView> SafetensorsFile::find(std::string_view name) const {
  const TensorInfo* t = header_.find(name);
  if (!t) return std::nullopt;
  return view(*t);
}

TensorView SafetensorsFile::at(std::string_view name) const {
  auto v = find(name);
  if (!v) throw NotFoundError(fmt::format("{}: no tensor '{}'", path_, name));
  return *v;
}

// ---- writer ----

void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  // ordered_json keeps __metadata__ first and tensors in data order, which
  // makes the files easy to eyeball; readers do not depend on key order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (t.name == "__metadata__")
      throw FormatError(fmt::format("{}: '__metadata__' is not a tensor name", file));
    if (!seen.insert(t.name).second)
      throw FormatError(fmt::format("{}: tensor '{}' given twice", file, t.name));
    uint64_t numel = 1;
    for (int64_t d : t.shape)
      if (d < 0 || __builtin_mul_overflow(numel, uint64_t(d), &numel))
        throw FormatError(
            fmt::format("{}: tensor '{}': invalid shape {}", file, t.name, format_shape(t.shape)));
    if (numel * dtype_size(t.dtype) != t.bytes)
      throw FormatError(fmt::format("{}: tensor '{}': {} {} needs {} bytes, given {}", file, t.name,
                                    to_string(t.dtype), format_shape(t.shape), numel * dtype_size(t.dtype),
                                    t.bytes));
    if (t.bytes > 0 && !t.data) throw FormatError(fmt::format("{}: tensor '{}': null data", file, t.name));
    header[t.name] = {
        {"dtype", to_string(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::filesystem::path tmp = path;
  tmp += ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(fmt::format("{}: cannot create: {}", tmp.string(), errno_text()));
  bool ok = true;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, f) == 8;
  ok = ok && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  for (const auto& t : tensors) {
    if (!ok) break;
    if (t.bytes) ok = std::fwrite(t.data, 1, t.bytes, f) == t.bytes;
  }
  const std::string why = ok ? "" : errno_text();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw Error(fmt::format("{}: write failed: {}", tmp.string(), why.empty() ? errno_text() : why));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    const std::string why = ec.message();  // (before the clean-up reuses the code)
    std::filesystem::remove(tmp, ec);
    throw Error(fmt::format("{}: rename from {} failed: {}", file, tmp.string(), why));
  }
}

// ---- Checkpoint ----

namespace {

// Shard names come from an untrusted index: only plain relative paths that stay
// inside the checkpoint directory. The check is lexical on purpose: Hugging
// Face cache snapshots are symlinks into ../../blobs, so resolving links
// would reject every cached checkpoint.
void check_shard_name(const std::string& shard, const std::string& index_file, const std::string& tensor) {
  const std::filesystem::path p(shard);
  auto bad = [&](std::string_view why) {
    throw FormatError(
        fmt::format("{}: tensor '{}' maps to file '{}', which {}", index_file, tensor, shard, why));
  };
  if (shard.empty()) bad("is empty");
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) bad("is an absolute path");
  for (const auto& part : p)
    if (part == "..") bad("escapes the checkpoint directory");
}

}  // namespace

Checkpoint::Checkpoint(const std::filesystem::path& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir_))
    throw NotFoundError(fmt::format("{}: not a checkpoint directory", dir_.string()));
  const fs::path index_path = dir_ / "model.safetensors.index.json";
  const fs::path single = dir_ / "model.safetensors";

  if (!fs::exists(index_path)) {
    if (!fs::exists(single))
      throw NotFoundError(
          fmt::format("{}: neither model.safetensors.index.json nor model.safetensors found", dir_.string()));
    files_.emplace_back(single);
    for (const auto& t : files_[0].tensors()) index_.emplace(t.name, 0);
    return;
  }

  const std::string index_file = index_path.string();
  json index;
  {
    std::ifstream in(index_path, std::ios::binary);
    if (!in) throw Error(fmt::format("{}: cannot open", index_file));
    try {
      index = json::parse(in, GuardedParse(index_file));
    } catch (const json::exception& e) {
      throw FormatError(fmt::format("{}: not valid JSON: {}", index_file, e.what()));
    }
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw FormatError(fmt::format("{}: expected an object with a 'weight_map' object", index_file));

  // Open each shard once, in name order, and remember which tensors the index
  // says it holds.
  std::map<std::string, std::vector<std::string>> wanted;  // shard -> tensors
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string())
      throw FormatError(fmt::format("{}: tensor '{}' maps to {}, expected a file name", index_file, tensor,
                                    json_type(shard)));
    const auto& s = shard.get_ref<const std::string&>();
    check_shard_name(s, index_file, tensor);
    wanted[s].push_back(tensor);
  }
  for (const auto& [shard, tensors] : wanted) {
    const fs::path p = dir_ / shard;
    if (!fs::exists(p))
      throw NotFoundError(fmt::format("{}: file '{}' (holding '{}' and {} more tensors) does not exist",
                                      index_file, shard, tensors.front(), tensors.size() - 1));
    files_.emplace_back(p);
    const SafetensorsFile& f = files_.back();
    for (const auto& t : tensors)
      if (!f.header().find(t))
        throw FormatError(fmt::format("{}: tensor '{}' is listed in {} but not present in the file", f.path(),
                                      t, index_file));
    // Tensors the index forgot are still served; a name in two shards is ambiguous.
    for (const auto& t : f.tensors()) {
      auto [it, fresh] = index_.emplace(t.name, files_.size() - 1);
      if (!fresh)
        throw FormatError(
            fmt::format("{}: tensor '{}' is also in {}", f.path(), t.name, files_[it->second].path()));
    }
  }
}

std::optional<TensorView> Checkpoint::find(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return files_[it->second].find(name);
}

TensorView Checkpoint::lookup(std::string_view name) const {
  auto v = find(name);
  if (!v) throw NotFoundError(fmt::format("{}: no tensor '{}' in the checkpoint", dir_.string(), name));
  return *v;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [n, _] : index_) out.push_back(n);
  return out;
}

std::vector<std::string> Checkpoint::names_with_prefix(std::string_view prefix) const {
  std::vector<std::string> out;
  for (auto it = index_.lower_bound(prefix); it != index_.end() && it->first.starts_with(prefix); ++it)
    out.push_back(it->first);
  return out;
}

}  // namespace megamoe::io
