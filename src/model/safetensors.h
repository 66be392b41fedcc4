// Reading Hugging Face safetensors checkpoints: one file or shards through
// model.safetensors.index.json.
//
// Files are mmapped read-only; a TensorView points into the mapping, so loading copies nothing
// until a backend converts or uploads the data. The header is validated in full before any tensor
// is used: the JSON shape, dtypes, that every data range lies inside the file and ranges do not
// overlap, and that byte sizes equal shape x dtype size. Every error names the file and the tensor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace relay {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapped file
  size_t nbytes = 0;
  std::string file;  // the shard it lives in, for error messages

  int64_t numel() const;
};

// Widens an F32/F16/BF16 tensor to fp32 (the CPU backend's compute type); other dtypes throw,
// naming the tensor and its file.
std::vector<float> tensor_to_f32(const TensorView& t);
// The same, into `out` (t.numel() floats).
void tensor_to_f32(const TensorView& t, float* out);

// A rectangular part of a tensor copied out of the file: `view` describes it (same name, file and
// dtype; shape [rows, cols], or [cols] for a 1-D tensor) and points into `bytes`.
struct TensorSlice {
  std::vector<uint8_t> bytes;
  TensorView view;
};
// Rows [row_begin, +rows) x columns [col_begin, +cols) of the 2-D tensor t (a 1-D tensor is one row:
// row_begin 0, rows 1), for any dtype. Throws naming the tensor when the range is outside it.
TensorSlice slice_tensor(const TensorView& t, int64_t row_begin, int64_t rows, int64_t col_begin,
                         int64_t cols);

// One mmapped .safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::filesystem::path& path() const { return path_; }

  // Parses and validates a header (the JSON text) for a file whose data section has
  // `data_bytes` bytes; exposed for the fuzzer and tests. `data` may be null when only validating.
  static std::map<std::string, TensorView> parse_header(
      std::string_view header_json, const uint8_t* data, size_t data_bytes, const std::string& file,
      std::map<std::string, std::string>* metadata);

 private:
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint directory (single file or sharded).
class Checkpoint {
 public:
  explicit Checkpoint(const std::filesystem::path& dir);
  // A checkpoint of in-memory tensors (the dummy load format, model/dummy_weights.h): `views`
  // point into `storage`, which the checkpoint keeps; `dir` names it in messages.
  Checkpoint(const std::filesystem::path& dir, std::vector<TensorView> views,
             std::vector<std::vector<uint8_t>> storage);
  Checkpoint(Checkpoint&&) = default;
  Checkpoint& operator=(Checkpoint&&) = default;

  bool has(const std::string& name) const;
  // The tensor `name`; throws naming the checkpoint and the tensor when it is missing.
  const TensorView& get(const std::string& name) const;
  // Like get, and checks the shape: the error names the tensor, the file and both shapes.
  const TensorView& get(const std::string& name, const std::vector<int64_t>& expected_shape) const;
  std::vector<std::string> names() const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // In-memory checkpoints: index_ points into views_, whose data point into storage_ (moving the
  // vectors keeps their buffers, so the pointers survive a move of the checkpoint).
  std::vector<TensorView> views_;
  std::vector<std::vector<uint8_t>> storage_;
  std::map<std::string, const TensorView*> index_;
};

// Writes tensors to one safetensors file (used by make-model and quantize).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// The streaming form, for files larger than memory: the header is written from `specs`, then
// `fill(i, offset, out)` is called for tensor i, in order, once per chunk of at most
// kWriteChunkBytes, to produce bytes [offset, offset + out.size()) of that tensor. `fill` runs on
// the calling thread while a helper thread writes the previous chunk; memory stays bounded by two
// chunks, whatever the tensor sizes.
struct TensorSpec {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};
inline constexpr size_t kWriteChunkBytes = size_t{64} << 20;
size_t tensor_bytes(const TensorSpec& spec);
void write_safetensors_streamed(
    const std::filesystem::path& path, const std::vector<TensorSpec>& specs,
    const std::function<void(size_t index, size_t byte_offset, std::span<uint8_t> out)>& fill,
    const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace relay
