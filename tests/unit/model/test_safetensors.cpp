// Safetensors reading and writing: round trips for every dtype, sharded checkpoints, and every kind
// of broken file (each error must name the file and, where there is one, the tensor). The last test
// is the deterministic cousin of tests/fuzz: many random and mutated headers must only ever produce
// relay::Error.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/safetensors.h"

namespace relay {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           str("relay_test_st_", ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a file with the given header text (length prefix added) and data section.
  fs::path write_raw(const std::string& name, const std::string& header, size_t data_bytes) {
    const fs::path p = dir_ / name;
    std::ofstream out(p, std::ios::binary);
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << header << std::string(data_bytes, '\x11');
    return p;
  }

  // Expects `fn` to throw a relay::Error whose message contains all of `parts`.
  template <typename Fn>
  void expect_error(Fn&& fn, std::initializer_list<std::string> parts) {
    try {
      fn();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      for (const std::string& p : parts)
        EXPECT_NE(msg.find(p), std::string::npos) << msg << " lacks " << p;
    }
  }

  fs::path dir_;
};

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

TEST_F(SafetensorsTest, RoundTripsEveryDtype) {
  std::vector<TensorToWrite> tensors;
  const DType dtypes[] = {DType::F32,     DType::F16,  DType::BF16, DType::F8_E4M3,
                          DType::F8_E8M0, DType::I32,  DType::I64,  DType::U8,
                          DType::I8,      DType::BOOL, DType::F64};
  uint8_t seed = 1;
  for (DType t : dtypes) {
    const std::vector<int64_t> shape = {3, 5};
    tensors.push_back({str("w.", dtype_name(t)), t, shape, pattern(15 * dtype_size(t), seed++)});
  }
  tensors.push_back({"scalar", DType::F32, {}, pattern(4, 9)});
  tensors.push_back({"empty", DType::BF16, {0, 4}, {}});
  const fs::path p = dir_ / "all.safetensors";
  write_safetensors(p, tensors, {{"format", "pt"}, {"note", "x"}});

  const SafetensorsFile f(p);
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "x"}}));
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (const TensorToWrite& w : tensors) {
    const TensorView& v = f.tensors().at(w.name);
    EXPECT_EQ(v.dtype, w.dtype) << w.name;
    EXPECT_EQ(v.shape, w.shape) << w.name;
    EXPECT_EQ(v.file, p.string());
    ASSERT_EQ(v.nbytes, w.bytes.size()) << w.name;
    EXPECT_EQ(0, std::memcmp(v.data, w.bytes.data(), v.nbytes)) << w.name;
  }
  EXPECT_EQ(f.tensors().at("scalar").numel(), 1);
  EXPECT_EQ(f.tensors().at("empty").numel(), 0);

  // The header is padded with spaces to 8 bytes, as the Python library writes it.
  std::ifstream in(p, std::ios::binary);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  EXPECT_EQ(len % 8, 0u);
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  EXPECT_EQ(header.front(), '{');
  EXPECT_TRUE(header.back() == '}' || header.back() == ' ');
}

TEST_F(SafetensorsTest, ConvertsToF32) {
  const std::vector<float> values = {1.0f, -2.5f, 0.15625f};
  std::vector<uint8_t> f32(12), bf16(6), f16(6);
  std::memcpy(f32.data(), values.data(), 12);
  for (size_t i = 0; i < 3; ++i) {
    const uint16_t b = f32_to_bf16(values[i]), h = f32_to_f16(values[i]);
    std::memcpy(bf16.data() + 2 * i, &b, 2);
    std::memcpy(f16.data() + 2 * i, &h, 2);
  }
  const fs::path p = dir_ / "f.safetensors";
  write_safetensors(p, {{"a", DType::F32, {3}, f32},
                        {"b", DType::BF16, {3}, bf16},
                        {"c", DType::F16, {3}, f16},
                        {"d", DType::I32, {3}, f32}});
  const SafetensorsFile f(p);
  for (const char* name : {"a", "b", "c"})
    EXPECT_EQ(tensor_to_f32(f.tensors().at(name)), values) << name;
  expect_error([&] { tensor_to_f32(f.tensors().at("d")); }, {"d", "I32", p.string()});
}

TEST_F(SafetensorsTest, StreamedWriterFillsInOrderAndInChunks) {
  // The second tensor spans three chunks (64 MiB + 64 MiB + 8 bytes).
  const int64_t big = static_cast<int64_t>(2 * kWriteChunkBytes / 4 + 2);
  std::vector<TensorSpec> specs = {{"x", DType::BF16, {2, 3}}, {"y", DType::F32, {big}}};
  std::vector<std::pair<size_t, size_t>> calls;
  const fs::path p = dir_ / "s.safetensors";
  write_safetensors_streamed(p, specs, [&](size_t i, size_t offset, std::span<uint8_t> out) {
    calls.emplace_back(i, offset);
    for (size_t k = 0; k < out.size(); ++k)
      out[k] = static_cast<uint8_t>(i + (offset + k) / kWriteChunkBytes);
  });
  EXPECT_EQ(calls, (std::vector<std::pair<size_t, size_t>>{
                       {0, 0}, {1, 0}, {1, kWriteChunkBytes}, {1, 2 * kWriteChunkBytes}}));
  const SafetensorsFile f(p);
  const TensorView& y = f.tensors().at("y");
  ASSERT_EQ(y.nbytes, tensor_bytes(specs[1]));
  EXPECT_EQ(y.data[0], 1);
  EXPECT_EQ(y.data[kWriteChunkBytes], 2);
  EXPECT_EQ(y.data[y.nbytes - 1], 3);
  EXPECT_FALSE(fs::exists(dir_ / "s.safetensors.tmp"));
  expect_error(
      [&] {
        write_safetensors(dir_ / "bad.safetensors", {{"x", DType::F32, {3}, pattern(8, 0)}});
      },
      {"x", "12"});
}

TEST_F(SafetensorsTest, ShardedCheckpoint) {
  write_safetensors(
      dir_ / "model-00001-of-00002.safetensors",
      {{"a", DType::BF16, {2, 2}, pattern(8, 1)}, {"b", DType::F32, {3}, pattern(12, 2)}});
  write_safetensors(dir_ / "model-00002-of-00002.safetensors",
                    {{"c", DType::BF16, {4}, pattern(8, 3)}});
  json index = {{"metadata", {{"total_size", 28}}},
                {"weight_map",
                 {{"a", "model-00001-of-00002.safetensors"},
                  {"b", "model-00001-of-00002.safetensors"},
                  {"c", "model-00002-of-00002.safetensors"}}}};
  auto write_index = [&](const json& j) {
    std::ofstream(dir_ / "model.safetensors.index.json") << j.dump();
  };
  write_index(index);

  const Checkpoint ck(dir_);
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(ck.has("c"));
  EXPECT_FALSE(ck.has("d"));
  EXPECT_EQ(ck.get("c").file, (dir_ / "model-00002-of-00002.safetensors").string());
  EXPECT_EQ(ck.get("a", {2, 2}).data[0], 1);
  expect_error([&] { ck.get("d"); }, {dir_.string(), "d"});
  expect_error([&] { ck.get("a", {4}); },
               {"model-00001-of-00002.safetensors", "tensor a", "[2, 2]", "[4]"});

  // The index names a tensor its shard does not hold.
  json bad = index;
  bad["weight_map"]["c"] = "model-00001-of-00002.safetensors";
  write_index(bad);
  expect_error([&] { Checkpoint{dir_}; }, {"tensor c", "model-00001-of-00002.safetensors"});
  // A listed shard is missing.
  bad = index;
  bad["weight_map"]["d"] = "model-00003-of-00003.safetensors";
  write_index(bad);
  expect_error([&] { Checkpoint{dir_}; }, {"model-00003-of-00003.safetensors", "does not exist"});
  // Shards must sit next to the index.
  bad = index;
  bad["weight_map"]["c"] = "../model-00002-of-00002.safetensors";
  write_index(bad);
  expect_error([&] { Checkpoint{dir_}; }, {"c", "not a file"});
  write_index(json{{"metadata", json::object()}});
  expect_error([&] { Checkpoint{dir_}; }, {"weight_map"});
  std::ofstream(dir_ / "model.safetensors.index.json") << "{";
  expect_error([&] { Checkpoint{dir_}; }, {"model.safetensors.index.json"});
  // A tensor in two shards is ambiguous.
  write_safetensors(dir_ / "model-00002-of-00002.safetensors",
                    {{"a", DType::BF16, {2, 2}, pattern(8, 3)}});
  index["weight_map"].erase("c");
  index["weight_map"]["a"] = "model-00002-of-00002.safetensors";
  write_index(index);
  expect_error([&] { Checkpoint{dir_}; }, {"tensor a", "both"});

  fs::remove_all(dir_);
  fs::create_directories(dir_);
  expect_error([&] { Checkpoint{dir_}; }, {dir_.string(), "model.safetensors"});
}

TEST_F(SafetensorsTest, TruncatedFilesNameTheFile) {
  const fs::path p = dir_ / "t.safetensors";
  write_safetensors(p, {{"w", DType::F32, {16}, pattern(64, 1)}});
  const size_t full = fs::file_size(p);
  for (size_t keep : {size_t{0}, size_t{5}, size_t{8}, size_t{20}, full - 1}) {
    write_safetensors(p, {{"w", DType::F32, {16}, pattern(64, 1)}});
    fs::resize_file(p, keep);
    expect_error([&] { SafetensorsFile{p}; }, {p.string()});
  }
  // A cut in the data section names the tensor that runs past the end.
  write_safetensors(p, {{"w", DType::F32, {16}, pattern(64, 1)}});
  fs::resize_file(p, full - 4);
  expect_error([&] { SafetensorsFile{p}; }, {p.string(), "tensor w", "truncated"});
  expect_error([&] { SafetensorsFile{dir_ / "absent.safetensors"}; }, {"absent.safetensors"});
}

TEST_F(SafetensorsTest, CorruptHeadersAreRejected) {
  struct Case {
    std::string header;
    size_t data_bytes;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"{not json", 0, {"not valid JSON"}},
      {"[1, 2]", 0, {"not a JSON object"}},
      {R"({"w": 3})", 0, {"tensor w", "object"}},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8, {"tensor w", "dtype"}},
      {R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", 8, {"tensor w", "shape"}},
      {R"({"w": {"dtype": "F32", "shape": [2]}})", 8, {"tensor w", "data_offsets"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})",
       8,
       {"tensor w", "data_offsets"}},
      {R"({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8, {"tensor w", "Q4"}},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})",
       8,
       {"tensor w", "non-negative"}},
      {R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})",
       8,
       {"tensor w", "shape"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})",
       8,
       {"tensor w", "reversed"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})",
       8,
       {"tensor w", "beyond"}},
      {R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
       8,
       {"tensor w", "needs 12"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}})",
       8,
       {"tensor w", "extra"}},
      {R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})",
       8,
       {"tensor w", "too large"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 18446744073709551615]}})",
       8,
       {"tensor w", "too large"}},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
       12,
       {"tensor b", "overlap"}},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
       20,
       {"tensor b", "gap"}},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
       12,
       {"12 bytes", "cover 8"}},
      {R"({"__metadata__": {"k": 1}})", 0, {"__metadata__"}},
      {R"({"__metadata__": [1]})", 0, {"__metadata__"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    const fs::path p = write_raw(str("c", i++, ".safetensors"), c.header, c.data_bytes);
    try {
      SafetensorsFile f(p);
      ADD_FAILURE() << "accepted " << c.header;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      for (const std::string& part : c.parts)
        EXPECT_NE(msg.find(part), std::string::npos) << msg << " lacks " << part;
    }
  }
  // A length field pointing past the end of the file, and an absurd one.
  const fs::path p = dir_ / "len.safetensors";
  {
    std::ofstream out(p, std::ios::binary);
    const uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
  }
  expect_error([&] { SafetensorsFile{p}; }, {p.string(), "truncated"});
  {
    std::ofstream out(p, std::ios::binary);
    const uint64_t n = ~uint64_t{0};
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
  }
  expect_error([&] { SafetensorsFile{p}; }, {p.string(), "header length"});
  // Valid edge cases: an empty header object, trailing space padding.
  EXPECT_TRUE(SafetensorsFile(write_raw("e.safetensors", "{}      ", 0)).tensors().empty());
}

// Random and mutated headers must produce a relay::Error or a valid parse — never anything else.
TEST(SafetensorsFuzz, RandomHeadersOnlyThrowRelayErrors) {
  std::mt19937_64 rng(20261202);
  // Valid headers and the data-section size each needs.
  const std::vector<std::pair<std::string, size_t>> seeds = {
      {R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
       16},
      {R"({"w":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}})", 4},
      {R"({"x":{"dtype":"I64","shape":[],"data_offsets":[0,8]},"y":{"dtype":"BOOL","shape":[0],"data_offsets":[8,8]}})",
       8},
  };
  const std::string alphabet =
      "{}[]\":,0123456789-.eE abcdefghijklmnopqrstuvwxyzFBI_\\\x00\xff\xc3";
  int parsed = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const auto& [seed, seed_bytes] = seeds[rng() % seeds.size()];
    std::string h = seed;
    const int mode = static_cast<int>(rng() % 4);
    if (mode == 0) {  // pure noise
      h.resize(rng() % 64);
      for (char& ch : h) ch = alphabet[rng() % alphabet.size()];
    } else {  // 1..8 point mutations: replace, insert, delete, or splice a number
      const int n = 1 + static_cast<int>(rng() % 8);
      for (int k = 0; k < n && !h.empty(); ++k) {
        const size_t pos = rng() % h.size();
        switch (rng() % 4) {
          case 0:
            h[pos] = alphabet[rng() % alphabet.size()];
            break;
          case 1:
            h.insert(pos, 1, alphabet[rng() % alphabet.size()]);
            break;
          case 2:
            h.erase(pos, 1);
            break;
          default:
            h.insert(pos, std::to_string(static_cast<int64_t>(rng())));
            break;
        }
      }
    }
    const size_t data_bytes = rng() % 2 ? seed_bytes : rng() % 32;
    std::vector<uint8_t> data(data_bytes);
    try {
      std::map<std::string, std::string> meta;
      SafetensorsFile::parse_header(h, data.data(), data.size(), "fuzz", &meta);
      ++parsed;
    } catch (const Error&) {
      // expected for most inputs
    } catch (const std::exception& e) {
      std::string hex;
      for (unsigned char ch : h) hex += str(std::hex, static_cast<int>(ch), " ");
      FAIL() << "non-relay exception " << e.what() << " for header bytes " << hex;
    }
  }
  // Some mutations leave valid headers; the seeds themselves parse.
  EXPECT_GT(parsed, 0);
}

}  // namespace
}  // namespace relay
