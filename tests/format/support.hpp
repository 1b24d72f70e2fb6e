// Helpers shared by the format suites (tests/format/*_test.cpp), the tests for the storage module's
// format partition (shardckpt.storage:format): the HDF5 layout of a checkpoint, both write and read
// paths, checksums on every path, atomic commit, and a reader that refuses damaged or hostile files
// with a typed error instead of crashing.
#pragma once
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "fuzz_one.hpp"
#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;

using namespace shardckpt;
using testing_support::error_of;
using testing_support::have_python_module;
using testing_support::run_python;
using testing_support::ScratchDir;

namespace {

// w.z (bf16, 6 x 4) is written in two row pieces; w.out (f32, 5 x 4 x 2) in two column bands (dim 1
// split in halves), as a row-parallel weight is. Checksums follow the write order below.
constexpr std::int64_t two_checksums = 16;
inline std::vector<Dataset> two_datasets(bool chunked = false) {
  return {{"w.z", DType::bf16, {6, 4}, std::nullopt, {}, {{{{0, 2}, {0, 4}}, 0}, {{{2, 6}, {0, 4}}, 2}}},
          {"w.out",
           DType::f32,
           {5, 4, 2},
           std::nullopt,
           chunked ? std::vector<std::int64_t>{3, 2, 2} : std::vector<std::int64_t>{},
           {{{{0, 5}, {0, 4}}, 6}, {{{0, 5}, {4, 8}}, 11}}}};
}

inline float out_value(std::size_t i) { return static_cast<float>(i) * 3; }

// Writes every element of both datasets: z[i] = i + 0.5, out[i] = 3 i (flat indices).
inline void write_into(io::File& file, IoMethod method, bool chunked = false,
                       Values common = {{"iteration", std::int64_t{7}}}) {
  const Skeleton sk = create_skeleton(file, two_datasets(chunked),
                                      {CheckpointKind::global, {}, std::move(common), std::string(32, 'a')}, two_checksums);
  HostBuffer z = HostBuffer::zeros(DType::bf16, {6, 4});
  auto zv = z.mut_view().as<bf16>();
  for (std::size_t i = 0; i < zv.size(); ++i) zv[i] = to_bf16(static_cast<float>(i) + 0.5f);
  HostBuffer left = HostBuffer::zeros(DType::f32, {5, 2, 2}), right = HostBuffer::zeros(DType::f32, {5, 2, 2});
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 4; ++c) {
      left.mut_view().as<float>()[static_cast<std::size_t>(r * 4 + c)] = out_value(static_cast<std::size_t>(r * 8 + c));
      right.mut_view().as<float>()[static_cast<std::size_t>(r * 4 + c)] =
          out_value(static_cast<std::size_t>(r * 8 + 4 + c));
    }
  PieceWriter w(file, method, ChecksumSlot{sk.checksums_address, 0});
  w.write(sk.datasets[0], std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{2, 4}, z.view().slice_rows(0, 2));
  w.write(sk.datasets[0], std::vector<std::int64_t>{2, 0}, std::vector<std::int64_t>{4, 4}, z.view().slice_rows(2, 6));
  w.write(sk.datasets[1], std::vector<std::int64_t>{0, 0, 0}, std::vector<std::int64_t>{5, 2, 2}, left.view());
  w.write(sk.datasets[1], std::vector<std::int64_t>{0, 2, 0}, std::vector<std::int64_t>{5, 2, 2}, right.view());
  (void)w.finish();  // a bare file, not a CheckpointWriter: the test seals it itself
  mark_complete(file, sk.data);
}

inline void write_all(const std::filesystem::path& path, IoMethod method, bool chunked = false,
                      Values common = {{"iteration", std::int64_t{7}}}) {
  io::File file = io::File::create(path);
  write_into(file, method, chunked, std::move(common));
}

inline Skeleton skeleton_at(const std::filesystem::path& path, std::span<const Dataset> datasets,
                            std::int64_t checksum_rows) {
  io::File file = io::File::create(path);
  return create_skeleton(file, datasets, {}, checksum_rows);
}

inline std::vector<float> read_out(const CheckpointReader& r, ReadOptions options = {}) {
  const Dataset& d = r.dataset("w.out");
  HostBuffer b = HostBuffer::zeros(DType::f32, {5, 4, 2});
  r.read(d, std::vector<std::int64_t>{0, 0, 0}, d.shape, b.mut_view(), options);
  auto v = b.view().as<float>();
  return {v.begin(), v.end()};
}


// The python lines, inside `with h5py.File(...) as f:`, that give `f` the metadata of a format
// version 1 checkpoint (before checksums existed).
constexpr const char* version1_metadata = R"(
    m = f.create_group("_shardckpt")
    m.create_group("common")
    m.attrs["format"] = np.bytes_("shardckpt")
    m.attrs["format_version"] = np.int64(1)
    m.attrs["kind"] = np.bytes_("global")
    m.attrs["params"] = np.bytes_("[]")
    m.attrs["complete"] = np.int64(1)
)";

using testing_support::contains;

// Byte address of the first element of a contiguous dataset, through h5py.
inline std::uint64_t data_address(const std::filesystem::path& file, const std::string& key) {
  const std::filesystem::path out = file.string() + ".addr";
  EXPECT_EQ(run_python("import h5py, sys\nopen(sys.argv[2], 'w').write(str(h5py.File(sys.argv[1], 'r')[sys.argv[3]].id."
                       "get_offset()))\n",
                       file.string() + " " + out.string() + " " + key),
            0);
  std::uint64_t address = 0;
  std::ifstream(out) >> address;
  std::filesystem::remove(out);
  return address;
}

inline void flip_byte(const std::filesystem::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  const char c = static_cast<char>(f.get());
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x10));
}

}  // namespace
