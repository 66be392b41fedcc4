// Safetensors reading (mmap + full header validation) and writing.
//
// The validation is as strict as the reference `safetensors` library: the header is a JSON object
// of at most kMaxHeaderBytes; every tensor entry has exactly dtype, shape and data_offsets; the
// data ranges, sorted, tile the data section exactly (no gaps, no overlaps, nothing left over); and
// each range holds exactly numel x dtype-size bytes, computed without overflow. Anything else is a
// relay::Error naming the file (and the tensor when there is one) — a corrupt or hostile file must
// never crash the process, which the fuzz target checks.
//
// Writing follows the Python library's layout (header padded with spaces to a multiple of 8 bytes,
// so tensor data is 8-byte aligned in the file) and streams in chunks of at most kWriteChunkBytes
// through two buffers, so a 16 GB shard needs 128 MiB of memory and producing data overlaps the
// disk writes. Files are written under a temporary name and renamed, so an interrupted write never
// leaves a truncated checkpoint behind.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <future>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace relay {
namespace {

using nlohmann::json;

// The reference library's limit; it keeps a corrupt length field from making us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += str(i ? ", " : "", shape[i]);
  return s + "]";
}

// Reads a non-negative integer that fits in int64 from a header value; `what` names it on failure.
uint64_t header_uint(const json& v, const std::string& what) {
  if (!v.is_number_integer()) fail(str(what, " must be a non-negative integer, got ", v.dump()));
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX)) fail(str(what, " is too large: ", u));
    return u;
  }
  const int64_t i = v.get<int64_t>();
  if (i < 0) fail(str(what, " must be non-negative, got ", i));
  return static_cast<uint64_t>(i);
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorSlice slice_tensor(const TensorView& t, int64_t row_begin, int64_t rows, int64_t col_begin,
                         int64_t cols) {
  RELAY_CHECK(t.shape.size() == 1 || t.shape.size() == 2, "tensor ", t.name, " in ", t.file,
              " has ", t.shape.size(), " dimensions; only 1-D and 2-D tensors are sliced");
  const int64_t num_rows = t.shape.size() == 1 ? 1 : t.shape[0], num_cols = t.shape.back();
  RELAY_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= num_rows && col_begin >= 0 &&
                  cols >= 0 && col_begin + cols <= num_cols,
              "tensor ", t.name, " in ", t.file, ": slice rows [", row_begin, ", +", rows,
              ") cols [", col_begin, ", +", cols, ") outside its shape [", num_rows, ", ", num_cols,
              "]");
  const size_t elem = dtype_size(t.dtype);
  TensorSlice s;
  s.bytes.resize(static_cast<size_t>(rows * cols) * elem);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(s.bytes.data() + static_cast<size_t>(r * cols) * elem,
                t.data + (static_cast<size_t>((row_begin + r) * num_cols + col_begin)) * elem,
                static_cast<size_t>(cols) * elem);
  }
  s.view.name = t.name;
  s.view.file = t.file;
  s.view.dtype = t.dtype;
  s.view.shape = t.shape.size() == 1 ? std::vector<int64_t>{cols} : std::vector<int64_t>{rows, cols};
  s.view.data = s.bytes.data();
  s.view.nbytes = s.bytes.size();
  return s;
}

std::map<std::string, TensorView> SafetensorsFile::parse_header(
    std::string_view header_json, const uint8_t* data, size_t data_bytes, const std::string& file,
    std::map<std::string, std::string>* metadata) {
  json header;
  try {
    header = parse_json(header_json, str(file, ": the safetensors header"));
  } catch (const JsonError& e) {
    fail(str(file, ": corrupt safetensors header (", e.what(), ")"));
  }
  if (!header.is_object()) fail(str(file, ": corrupt safetensors header (not a JSON object)"));

  std::map<std::string, TensorView> tensors;
  struct Range {
    uint64_t begin, end;
    const std::string* name;
    bool operator<(const Range& o) const {
      return begin != o.begin ? begin < o.begin : end < o.end;
    }
  };
  std::vector<Range> ranges;  // [begin, end) per tensor, for the tiling check
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(str(file, ": __metadata__ must be an object of strings"));
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          fail(str(file, ": __metadata__ value for '", key, "' is not a string"));
        if (metadata) (*metadata)[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string what = str(file, ": tensor ", name);
    if (!entry.is_object()) fail(str(what, ": header entry must be an object"));
    for (const auto& [key, value] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(str(what, ": unknown header field '", key, "'"));
      }
    }
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail(str(what, ": missing dtype"));
    if (!entry.contains("shape") || !entry["shape"].is_array()) fail(str(what, ": missing shape"));
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2) {
      fail(str(what, ": data_offsets must be a list of two integers"));
    }
    TensorView t;
    t.name = name;
    t.file = file;
    t.dtype = parse_dtype(entry["dtype"].get<std::string>(), what);
    uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : entry["shape"]) {
      const uint64_t dim = header_uint(d, str(what, ": shape dimension"));
      t.shape.push_back(static_cast<int64_t>(dim));
      if (dim != 0 && numel > static_cast<uint64_t>(INT64_MAX) / dim) overflow = true;
      numel *= dim;
    }
    const uint64_t elem = dtype_size(t.dtype);
    if (overflow || numel > static_cast<uint64_t>(INT64_MAX) / elem) {
      fail(str(what, ": shape ", shape_string(t.shape), " is too large"));
    }
    const uint64_t begin = header_uint(entry["data_offsets"][0], str(what, ": data_offsets[0]"));
    const uint64_t end = header_uint(entry["data_offsets"][1], str(what, ": data_offsets[1]"));
    if (begin > end) fail(str(what, ": data_offsets [", begin, ", ", end, "] are reversed"));
    if (end > data_bytes) {
      fail(str(what, ": data_offsets [", begin, ", ", end, "] lie beyond the data section (",
               data_bytes, " bytes); the file is truncated or corrupt"));
    }
    t.nbytes = static_cast<size_t>(end - begin);
    if (t.nbytes != numel * elem) {
      fail(str(what, ": holds ", t.nbytes, " bytes but shape ", shape_string(t.shape), " of ",
               dtype_name(t.dtype), " needs ", numel * elem));
    }
    t.data = data ? data + begin : nullptr;
    const auto it = tensors.emplace(name, std::move(t)).first;
    ranges.push_back({begin, end, &it->first});
  }

  // Sorted ranges must tile [0, data_bytes): a gap means unaccounted bytes, an overlap means two
  // tensors alias the same memory; the reference library rejects both.
  std::sort(ranges.begin(), ranges.end());
  uint64_t expected_begin = 0;
  for (const Range& r : ranges) {
    if (r.begin != expected_begin) {
      fail(str(file, ": tensor ", *r.name, ": data_offsets [", r.begin, ", ", r.end, "] ",
               r.begin < expected_begin ? "overlap the previous tensor"
                                        : "leave a gap after the previous tensor",
               " (which ends at ", expected_begin, ")"));
    }
    expected_begin = r.end;
  }
  if (expected_begin != data_bytes) {
    fail(str(file, ": data section has ", data_bytes, " bytes but the tensors cover ",
             expected_begin));
  }
  return tensors;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path) : path_(path) {
  const std::string file = path.string();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(str(file, ": cannot open (", errno_text(), ")"));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    fail(str(file, ": cannot stat (", why, ")"));
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    fail(str(file, ": truncated (", file_bytes,
             " bytes; a safetensors file starts with an 8-byte header length)"));
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_error = map == MAP_FAILED ? errno_text() : std::string();
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) fail(str(file, ": mmap failed (", map_error, ")"));
  map_ = map;
  map_bytes_ = file_bytes;
  try {
    const auto* bytes = static_cast<const uint8_t*>(map_);
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | bytes[i];  // little-endian
    if (header_bytes > kMaxHeaderBytes) {
      fail(str(file, ": corrupt header length ", header_bytes, " (limit ", kMaxHeaderBytes, ")"));
    }
    if (header_bytes > file_bytes - 8) {
      fail(str(file, ": truncated (header needs ", header_bytes, " bytes, file has ",
               file_bytes - 8, " after the length)"));
    }
    const std::string_view header(reinterpret_cast<const char*>(bytes + 8), header_bytes);
    tensors_ = parse_header(header, bytes + 8 + header_bytes, file_bytes - 8 - header_bytes, file,
                            &metadata_);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

void tensor_to_f32(const TensorView& t, float* out) {
  const size_t n = static_cast<size_t>(t.numel());
  switch (t.dtype) {
    case DType::F32:
      std::memcpy(out, t.data, n * sizeof(float));
      return;
    case DType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = bf16_to_f32(v);
      }
      return;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = f16_to_f32(v);
      }
      return;
    default:
      fail(str(t.file, ": tensor ", t.name, " has dtype ", dtype_name(t.dtype),
               "; only F32, F16 and BF16 convert to f32"));
  }
}

std::vector<float> tensor_to_f32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  tensor_to_f32(t, out.data());
  return out;
}

Checkpoint::Checkpoint(const std::filesystem::path& dir) : dir_(dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = dir / "model.safetensors.index.json";
  const fs::path single_path = dir / "model.safetensors";
  auto add_file = [&](const fs::path& p) -> SafetensorsFile& {
    files_.push_back(std::make_unique<SafetensorsFile>(p));
    for (const auto& [name, view] : files_.back()->tensors()) {
      const auto [it, inserted] = index_.emplace(name, &view);
      if (!inserted) {
        fail(str(dir.string(), ": tensor ", name, " appears in both ", it->second->file, " and ",
                 view.file));
      }
    }
    return *files_.back();
  };

  if (fs::exists(index_path)) {
    const std::string what = index_path.string();
    const json index = parse_json_file(index_path);
    if (!index.is_object()) fail(str(what, ": not a JSON object"));
    if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
      fail(str(what, ": missing the weight_map object"));
    }
    std::map<std::string, std::string> shard_of;  // tensor -> shard file name
    std::set<std::string> shards;
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string())
        fail(str(what, ": weight_map entry for ", name, " is not a file name"));
      const std::string s = shard.get<std::string>();
      // Shards live next to the index; a path could point anywhere on the machine.
      if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..") {
        fail(str(what, ": weight_map entry for ", name, " names '", s, "', not a file in ",
                 dir.string()));
      }
      shard_of[name] = s;
      shards.insert(s);
    }
    if (shards.empty()) fail(str(what, ": weight_map is empty"));
    std::map<std::string, const SafetensorsFile*> loaded;
    for (const std::string& s : shards) {
      const fs::path p = dir / s;
      if (!fs::exists(p))
        fail(str(what, ": shard ", s, " is listed but ", p.string(), " does not exist"));
      loaded[s] = &add_file(p);
    }
    for (const auto& [name, s] : shard_of) {
      if (!loaded.at(s)->tensors().contains(name)) {
        fail(str(what, ": tensor ", name, " is listed in shard ", s, " but ", (dir / s).string(),
                 " does not contain it"));
      }
    }
  } else if (fs::exists(single_path)) {
    add_file(single_path);
  } else {
    fail(str(dir.string(), ": no model.safetensors or model.safetensors.index.json"));
  }
}

Checkpoint::Checkpoint(const std::filesystem::path& dir, std::vector<TensorView> views,
                       std::vector<std::vector<uint8_t>> storage)
    : dir_(dir), views_(std::move(views)), storage_(std::move(storage)) {
  for (const TensorView& v : views_) {
    RELAY_CHECK(index_.emplace(v.name, &v).second, dir.string(), ": tensor ", v.name,
                " appears twice");
  }
}

bool Checkpoint::has(const std::string& name) const { return index_.contains(name); }

const TensorView& Checkpoint::get(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail(str(dir_.string(), ": checkpoint has no tensor ", name));
  return *it->second;
}

const TensorView& Checkpoint::get(const std::string& name,
                                  const std::vector<int64_t>& expected_shape) const {
  const TensorView& t = get(name);
  if (t.shape != expected_shape) {
    fail(str(t.file, ": tensor ", name, " has shape ", shape_string(t.shape), ", expected ",
             shape_string(expected_shape)));
  }
  return t;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, view] : index_) out.push_back(name);
  return out;
}

size_t tensor_bytes(const TensorSpec& spec) {
  size_t n = dtype_size(spec.dtype);
  for (int64_t d : spec.shape) {
    RELAY_CHECK(d >= 0, "tensor ", spec.name, " has negative dimension ", d);
    n *= static_cast<size_t>(d);
  }
  return n;
}

void write_safetensors_streamed(
    const std::filesystem::path& path, const std::vector<TensorSpec>& specs,
    const std::function<void(size_t index, size_t byte_offset, std::span<uint8_t> out)>& fill,
    const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> seen;
  for (const TensorSpec& s : specs) {
    RELAY_CHECK(s.name != "__metadata__" && seen.insert(s.name).second, file,
                ": duplicate or reserved tensor name ", s.name);
    const uint64_t n = tensor_bytes(s);
    header[s.name] = {
        {"dtype", dtype_name(s.dtype)}, {"shape", s.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) fail(str(tmp.string(), ": cannot create (", errno_text(), ")"));
    uint8_t len[8];
    for (int i = 0; i < 8; ++i)
      len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    // Double buffering: tensors (small ones packed together) are produced into one buffer while a
    // helper thread writes the other, so generation and disk I/O overlap. The future is declared
    // after `out` and waited on before any buffer is reused; its destructor also waits, so an
    // exception from `fill` never leaves a write running against freed memory.
    std::vector<uint8_t> buffers[2];
    for (std::vector<uint8_t>& b : buffers) b.reserve(std::min<uint64_t>(kWriteChunkBytes, offset));
    int current = 0;
    std::future<void> pending;
    auto flush = [&] {
      if (pending.valid()) pending.get();
      const std::vector<uint8_t>* full = &buffers[current];
      pending = std::async(std::launch::async, [&out, full] {
        out.write(reinterpret_cast<const char*>(full->data()),
                  static_cast<std::streamsize>(full->size()));
      });
      current ^= 1;
      buffers[current].clear();
    };
    for (size_t i = 0; i < specs.size(); ++i) {
      const size_t total = tensor_bytes(specs[i]);
      for (size_t offset = 0; offset < total; offset += kWriteChunkBytes) {
        const size_t n = std::min(kWriteChunkBytes, total - offset);
        std::vector<uint8_t>& buffer = buffers[current];
        if (!buffer.empty() && buffer.size() + n > kWriteChunkBytes) flush();
        const size_t start = buffers[current].size();
        buffers[current].resize(start + n);
        fill(i, offset, std::span<uint8_t>(buffers[current].data() + start, n));
      }
    }
    if (!buffers[current].empty()) flush();
    if (pending.valid()) pending.get();
    out.flush();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      fail(str(tmp.string(), ": write failed (", errno_text(), ")"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) fail(str(file, ": cannot rename from ", tmp.string(), " (", ec.message(), ")"));
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const TensorToWrite& t : tensors) {
    specs.push_back({t.name, t.dtype, t.shape});
    RELAY_CHECK(tensor_bytes(specs.back()) == t.bytes.size(), path.string(), ": tensor ", t.name,
                " has ", t.bytes.size(), " bytes but shape ", shape_string(t.shape), " of ",
                dtype_name(t.dtype), " needs ", tensor_bytes(specs.back()));
  }
  write_safetensors_streamed(
      path, specs,
      [&](size_t i, size_t offset, std::span<uint8_t> out) {
        std::memcpy(out.data(), tensors[i].bytes.data() + offset, out.size());
      },
      metadata);
}

}  // namespace relay
