// Safetensors files (docs/numerics.md §2): a strict header parser, a read-only mmap reader
// with zero-copy tensor views, a writer, and Checkpoint, a directory of shards.
//
// Every header is untrusted input: parse_header() checks bounds, JSON depth,
// duplicate keys, dtype/shape/byte-size agreement and overlaps before any
// tensor is exposed, and every failure is an io::FormatError whose message
// names the file, the tensor (when there is one) and what was expected vs found.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace megamoe::io {

// Base of every I/O error, so callers can catch the layer's errors as a group.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The bytes (or a tensor's dtype/shape) are not what the format or model says.
class FormatError : public Error {
 public:
  using Error::Error;
};
// A file or tensor that should be there is not.
class NotFoundError : public Error {
 public:
  using Error::Error;
};

enum class Dtype {
  kBool,
  kU8,
  kI8,
  kF8_E4M3,
  kF8_E5M2,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kI64,
  kU64,
  kF64
};

// The safetensors spelling ("F8_E4M3", "BF16", ...).
std::string_view to_string(Dtype d);
// nullopt for a spelling we do not know (the parser turns that into an error).
std::optional<Dtype> parse_dtype(std::string_view s);
size_t dtype_size(Dtype d);

// "[2, 3]": how shapes appear in every message.
std::string format_shape(std::span<const int64_t> shape);

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
  uint64_t bytes() const { return end - begin; }
};

struct Header {
  uint64_t data_offset = 0;         // 8 + header length: where the data section starts in the file
  std::vector<TensorInfo> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;

  const TensorInfo* find(std::string_view name) const;
};

// Bounds the JSON header: real headers are a few MB for thousands of tensors.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// A valid header nests 3 deep ({ name: { shape: [ ); anything far deeper is hostile.
constexpr int kMaxJsonDepth = 8;

// Parses and validates the header of a whole safetensors file held in
// [data, data + size). Needs the whole file (not just the header) so that
// tensor offsets are checked against the real data section. `file_label` is
// used in messages only. Entry point for fuzzing: throws FormatError for any
// malformed input and never reads outside the buffer.
Header parse_header(const uint8_t* data, size_t size, std::string_view file_label);

// A zero-copy view of one tensor inside a mapped file; valid while the
// SafetensorsFile (or Checkpoint) that produced it is alive.
struct TensorView {
  std::string_view name;
  std::string_view file;  // path of the file it lives in, for messages
  Dtype dtype = Dtype::kU8;
  std::span<const int64_t> shape;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
};

// One safetensors file, memory-mapped read-only. Move-only.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }

  std::optional<TensorView> find(std::string_view name) const;
  // Throws NotFoundError naming the file and the tensor.
  TensorView at(std::string_view name) const;
  TensorView view(const TensorInfo& t) const;

 private:
  void unmap() noexcept;

  std::string path_;
  const uint8_t* map_ = nullptr;
  size_t size_ = 0;
  Header header_;
};

// One tensor to write: `data` points to `bytes` bytes, which must equal
// product(shape) * dtype_size(dtype).
struct TensorToWrite {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};

// Writes a safetensors file: 8-byte little-endian header length, the JSON
// header space-padded to a multiple of 8 bytes (so the data section, and every
// tensor whose size is a multiple of 8, starts 8-aligned), then the tensors in
// the order given. Writes `path.tmp` and renames it, so a crash never leaves a
// partial file under `path`. Throws FormatError for inconsistent input
// (duplicate names, byte size vs shape) and Error for I/O failures.
void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {});

// A checkpoint directory: model.safetensors.index.json and the shards it names,
// or a single model.safetensors. Every shard is opened (and its header
// validated) up front, so a bad shard fails at open rather than mid-load.
class Checkpoint {
 public:
  explicit Checkpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  size_t num_files() const { return files_.size(); }
  const SafetensorsFile& file(size_t i) const { return files_[i]; }

  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  std::optional<TensorView> find(std::string_view name) const;
  // Throws NotFoundError naming the tensor and the directory.
  TensorView lookup(std::string_view name) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  // The sorted names that start with `prefix`.
  std::vector<std::string> names_with_prefix(std::string_view prefix) const;

 private:
  std::filesystem::path dir_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> index_;  // tensor name -> index into files_
};

}  // namespace megamoe::io
