// Tests for shardckpt.format: the HDF5 layout of a checkpoint, both write and read paths, checksums
// on every path, atomic commit, and a reader that refuses damaged or hostile files with a typed
// error instead of crashing.
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
std::vector<Dataset> two_datasets(bool chunked = false) {
  return {{"w.z", DType::bf16, {6, 4}, std::nullopt, {}, {{{{0, 2}, {0, 4}}, 0}, {{{2, 6}, {0, 4}}, 2}}},
          {"w.out",
           DType::f32,
           {5, 4, 2},
           std::nullopt,
           chunked ? std::vector<std::int64_t>{3, 2, 2} : std::vector<std::int64_t>{},
           {{{{0, 5}, {0, 4}}, 6}, {{{0, 5}, {4, 8}}, 11}}}};
}

float out_value(std::size_t i) { return static_cast<float>(i) * 3; }

// Writes every element of both datasets: z[i] = i + 0.5, out[i] = 3 i (flat indices).
void write_into(io::File& file, IoMethod method, bool chunked = false,
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
  w.finish();
  mark_complete(file, sk.data);
}

void write_all(const std::filesystem::path& path, IoMethod method, bool chunked = false,
               Values common = {{"iteration", std::int64_t{7}}}) {
  io::File file = io::File::create(path);
  write_into(file, method, chunked, std::move(common));
}

Skeleton skeleton_at(const std::filesystem::path& path, std::span<const Dataset> datasets, std::int64_t checksum_rows) {
  io::File file = io::File::create(path);
  return create_skeleton(file, datasets, {}, checksum_rows);
}

std::vector<float> read_out(const CheckpointReader& r, ReadOptions options = {}) {
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
std::uint64_t data_address(const std::filesystem::path& file, const std::string& key) {
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

void flip_byte(const std::filesystem::path& file, std::uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  const char c = static_cast<char>(f.get());
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x10));
}

}  // namespace

TEST(Format, BothWritePathsProduceIdenticalTensorsContiguousOrChunked) {
  ScratchDir dir;
  for (bool chunked : {false, true}) {
    const auto direct = dir / (chunked ? "direct-c.h5" : "direct.h5"),
               hyper = dir / (chunked ? "hyper-c.h5" : "hyper.h5");
    write_all(direct, IoMethod::raw, chunked);
    write_all(hyper, IoMethod::hyperslab, chunked);
    const CheckpointReader a(direct), b(hyper);
    for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
      const auto va = read_out(a, {m}), vb = read_out(b, {m});
      EXPECT_EQ(va, vb);
      for (std::size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], out_value(i)) << i;
    }
    // Same tensors, same checksums: h5diff compares every element and the checksum table.
    EXPECT_TRUE(testing_support::same_tensors(direct, hyper));
    EXPECT_TRUE(testing_support::same_checksums(direct, hyper));
  }
  EXPECT_TRUE(testing_support::same_tensors(dir / "direct.h5", dir / "direct-c.h5"));
}

TEST(Format, ChunkedBandsReadAtAnyWidthAndEveryReadIsChecked) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw, true);
  const CheckpointReader r(dir / "c.h5");
  const Dataset& d = r.dataset("w.out");
  // Rows 1..4 of dim-1 columns [1, 3): across both bands, both row chunks, and half of each saved
  // unit (those are read whole, checked, and their asked-for part copied).
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
    HostBuffer b = HostBuffer::zeros(DType::f32, {3, 2, 2});
    r.read(d, std::vector<std::int64_t>{1, 1, 0}, std::vector<std::int64_t>{3, 2, 2}, b.mut_view(), {m});
    const auto v = b.view().as<float>();
    for (int row = 0; row < 3; ++row)
      for (int e = 0; e < 4; ++e)
        EXPECT_EQ(v[static_cast<std::size_t>(row * 4 + e)], out_value(static_cast<std::size_t>((row + 1) * 8 + 2 + e)))
            << row << " " << e;
  }
}

TEST(Format, DatasetsHaveGlobalShapesAndTheMetadataIsComplete) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const CheckpointReader r(dir / "c.h5");
  ASSERT_EQ(r.datasets().size(), 2u);
  EXPECT_EQ(r.version(), format_version);
  EXPECT_TRUE(r.checksummed());
  EXPECT_EQ(r.contents().id, std::string(32, 'a'));
  const Dataset& z = r.dataset("w.z");
  EXPECT_EQ(z.dtype, DType::bf16);
  EXPECT_EQ(z.shape, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(std::get<std::int64_t>(r.contents().common.at("iteration")), 7);
  HostBuffer rows = HostBuffer::zeros(DType::bf16, {3, 4});
  r.read(z, std::vector<std::int64_t>{1, 0}, std::vector<std::int64_t>{3, 4}, rows.mut_view());
  EXPECT_EQ(to_f32(rows.view().as<bf16>()[0]), 4.5f);  // element (1, 0) = 4 + 0.5
  ASSERT_EQ(r.slabs(z).size(), 2u);
  EXPECT_EQ(r.slabs(z)[1].box.rows, (Range{2, 6}));
  EXPECT_EQ(r.slabs(z)[1].first_checksum, 2);
}

TEST(Format, H5pyReadsTheTensorsAndRecomputesEveryChecksum) {
  if (!have_python_module("h5py") || !have_python_module("xxhash")) GTEST_SKIP() << "h5py or xxhash is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // What docs/format.md says a checksum is, checked by another implementation: XXH3-64 of the
  // stored bytes of each row of each slab, at first_checksum + (row - first row) in the table.
  EXPECT_EQ(run_python(R"(
import h5py, numpy as np, sys, xxhash
path = sys.argv[1]
f = h5py.File(path, "r")
assert f["w.z"].dtype.name == "float32" and f["w.z"][1, 0] == 4.5 and f["w.z"][5, 3] == 23.5
sums = f["_shardckpt/checksums"][()]
raw = open(path, "rb").read()
checked = 0
for key, table in f["_shardckpt/slabs"].attrs.items():
    d = f[key]
    size = 2 if key == "w.z" else 4
    row = int(np.prod(d.shape[1:])) * size
    base = d.id.get_offset()
    for r0, r1, c0, c1, first in table:
        for r in range(r0, r1):
            b = raw[base + r * row + c0 * size: base + r * row + c1 * size]
            assert xxhash.xxh3_64_intdigest(b) == int(sums[first + r - r0]), (key, r)
            checked += 1
assert checked == 16, checked
)",
                       (dir / "c.h5").string()),
            0);
}

TEST(Format, AFlippedDataByteIsCorruptNamingTheFileKeyAndRows) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
    const auto file = dir / (m == IoMethod::raw ? "d.h5" : "h.h5");
    write_all(file, IoMethod::raw);
    // Element (3, 1) of w.z: in the second slab, row 3.
    flip_byte(file, data_address(file, "w.z") + (3 * 4 + 1) * 2);
    const CheckpointReader r(file);
    HostBuffer all = HostBuffer::zeros(DType::bf16, {6, 4});
    const Error e = error_of([&] {
      r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, all.mut_view(), {m});
    });
    EXPECT_EQ(e.code(), Errc::corrupt);
    EXPECT_TRUE(contains(e.what(), file.string()) && contains(e.what(), "key w.z") && contains(e.what(), "rows [3, 4)"))
        << e.what();
    // Rows that do not hold the flipped byte read cleanly; unchecked, the bad row reads too.
    HostBuffer two = HostBuffer::zeros(DType::bf16, {2, 4});
    EXPECT_NO_THROW(r.read(r.dataset("w.z"), std::vector<std::int64_t>{4, 0}, std::vector<std::int64_t>{2, 4},
                           two.mut_view(), {m}));
    EXPECT_NO_THROW(r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4},
                           all.mut_view(), {m, false}));
    const VerifyReport v = verify_checkpoint(r);
    EXPECT_EQ(v.mismatches, 1);
    EXPECT_EQ(v.checksum_rows, two_checksums);
    ASSERT_EQ(v.problems.size(), 1u);
    EXPECT_TRUE(contains(v.problems[0], "rows [3, 4)")) << v.problems[0];
  }
}

TEST(Format, AFlippedByteInAPartOfAUnitOutsideTheReadIsStillFound) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // w.out row 2, flat element 1 (left band, dim-1 column 0): a read of dim-1 column 1 only still
  // reads the whole left-band unit of row 2 to check it.
  flip_byte(dir / "c.h5", data_address(dir / "c.h5", "w.out") + (2 * 8 + 1) * 4);
  const CheckpointReader r(dir / "c.h5");
  HostBuffer b = HostBuffer::zeros(DType::f32, {1, 1, 2});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.out"), std::vector<std::int64_t>{2, 1, 0}, std::vector<std::int64_t>{1, 1, 2},
                     b.mut_view());
            }).code(),
            Errc::corrupt);
  EXPECT_NO_THROW(r.read(r.dataset("w.out"), std::vector<std::int64_t>{2, 2, 0}, std::vector<std::int64_t>{1, 1, 2},
                         b.mut_view()));
}

TEST(Format, ReadsRejectAWrongDtypeOrSlab) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const CheckpointReader r(dir / "c.h5");
  HostBuffer f = HostBuffer::zeros(DType::f32, {6, 4});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, f.mut_view());
            }).code(),
            Errc::dtype_mismatch);
  HostBuffer b = HostBuffer::zeros(DType::bf16, {2, 4});
  EXPECT_EQ(error_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{5, 0}, std::vector<std::int64_t>{2, 4}, b.mut_view());
            }).code(),
            Errc::invalid_argument);
  EXPECT_EQ(error_of([&] { (void)r.dataset("w.q"); }).code(), Errc::missing_key);
}

TEST(Format, FilesThatAreNotCompleteCheckpointsAreRefused) {
  ScratchDir dir;
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "missing.h5"); }).code(), Errc::not_a_checkpoint);
  std::ofstream(dir / "text.h5") << "not hdf5 at all";
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "text.h5"); }).code(), Errc::not_a_checkpoint);
  // A skeleton that was never marked complete: a save that died half-way.
  (void)skeleton_at(dir / "partial.h5", two_datasets(), two_checksums);
  const Error e = error_of([&] { CheckpointReader r(dir / "partial.h5"); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(contains(e.what(), "did not finish")) << e.what();
  if (have_python_module("h5py")) {
    ASSERT_EQ(run_python("import h5py, sys\nh5py.File(sys.argv[1], 'w')['x'] = [1, 2]\n", (dir / "foreign.h5").string()),
              0);
    EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "foreign.h5"); }).code(), Errc::not_a_checkpoint);
  }
}

TEST(Format, TruncatedFileIsRefused) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  // Past the seal's trailer and into what HDF5 wrote.
  std::filesystem::resize_file(dir / "c.h5", std::filesystem::file_size(dir / "c.h5") - 4096);
  EXPECT_EQ(error_of([&] {
              const CheckpointReader r(dir / "c.h5");
              (void)read_out(r);
            }).code(),
            Errc::not_a_checkpoint);
}

TEST(Format, TheSealCatchesDamagedMetadataBeforeHdf5ReadsIt) {
  ScratchDir dir;
  const auto file = dir / "c.h5";
  write_all(file, IoMethod::raw);
  const std::optional<std::uint64_t> seal = CheckpointReader(file).seal();
  ASSERT_TRUE(seal.has_value());
  const std::string good = testing_support::file_bytes(file);
  const auto damaged = [&](std::uint64_t at) {
    std::ofstream(file, std::ios::binary) << good;
    flip_byte(file, at);
    return error_of([&] { CheckpointReader r(file); });
  };
  // The superblock, the root group's header, the seal's own trailer: each is refused as damaged,
  // naming the file, before HDF5 parses a byte.
  for (const std::uint64_t at : {std::uint64_t{8}, std::uint64_t{60}, good.size() - 30, good.size() - 60}) {
    const Error e = damaged(at);
    EXPECT_EQ(e.code(), Errc::corrupt) << "byte " << at << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), file.string())) << e.what();
  }
  // A rank that is told which seal another rank checked opens only that checkpoint.
  std::ofstream(file, std::ios::binary) << good;
  EXPECT_NO_THROW(CheckpointReader(file, {.trusted_seal = *seal}));
  EXPECT_EQ(error_of([&] { CheckpointReader r(file, {.trusted_seal = *seal + 1}); }).code(), Errc::replaced);
  EXPECT_EQ(error_of([&] { CheckpointReader r(file, {.trusted_seal = 0}); }).code(), Errc::replaced);
  // Without its trailer the file is read as an unsealed one (as after h5py changed it).
  std::filesystem::resize_file(file, good.size() - 48);
  EXPECT_FALSE(CheckpointReader(file).seal().has_value());
  const auto v = read_out(CheckpointReader(file));
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
}

TEST(Format, CommitReplacesAtomicallyAndDiscardCleansUp) {
  ScratchDir dir;
  const auto final_path = dir / "ckpt.h5";
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
    write_into(temp.file(), IoMethod::raw);
    EXPECT_FALSE(std::filesystem::exists(final_path));
    temp.commit();
  }
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_NO_THROW(CheckpointReader r(final_path));
  const std::string before = testing_support::file_bytes(final_path);
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
    (void)create_skeleton(temp.file(), two_datasets(), {}, two_checksums);
    EXPECT_EQ(testing_support::temporary_files(dir.path()).size(), 1u);
    temp.discard();
    EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  }
  {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(final_path));
  }  // never committed: removed
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  EXPECT_EQ(testing_support::file_bytes(final_path), before);
}

TEST(Format, AReaderKeepsReadingTheFileItOpenedWhenThePathIsReplaced) {
  ScratchDir dir;
  write_all(dir / "a.h5", IoMethod::raw, false, {{"tag", std::string("old")}});
  const CheckpointReader r(dir / "a.h5");
  write_all(dir / "b.h5", IoMethod::raw, false, {{"tag", std::string("new")}});
  std::filesystem::resize_file(dir / "b.h5", 4096);  // what the new file holds does not matter to r
  std::filesystem::rename(dir / "b.h5", dir / "a.h5");
  EXPECT_EQ(std::get<std::string>(r.contents().common.at("tag")), "old");
  const auto v = read_out(r);
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
  EXPECT_NE(r.identity(), io::File::open_read(dir / "a.h5").identity());
}

TEST(Format, Hdf5ErrorsNameTheFileAndKey) {
  ScratchDir dir;
  const std::vector<Dataset> dup{{"k", DType::f32, {2}, std::nullopt, {}, {}},
                                     {"k", DType::f32, {2}, std::nullopt, {}, {}}};
  const Error e = error_of([&] { (void)skeleton_at(dir / "d.h5", dup, 0); });
  EXPECT_EQ(e.code(), Errc::hdf5);
  EXPECT_TRUE(contains(e.what(), "of key k in ") && contains(e.what(), "d.h5")) << e.what();
  EXPECT_EQ(error_of([&] {
              (void)skeleton_at(dir / "bad.h5", std::vector<Dataset>{{"a/b", DType::f32, {2}, std::nullopt, {}, {}}},
                                0);
            }).code(),
            Errc::invalid_argument);
}

TEST(Format, ParamRecordsRoundTripAndPlanAtAnyTp) {
  ScratchDir dir;
  const ParamSpec spec{"in_proj.weight",
                       gdp_in_proj_sections({.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3}, 2),
                       {4},
                       TpAxis::rows,
                       2};
  const ParamRecord rec = record_of(spec);
  {
    io::File f = io::File::create(dir / "p.h5");
    const Skeleton sk = create_skeleton(
        f, {}, {CheckpointKind::global, {rec}, {{"name", std::string("demo")}, {"lr", 0.5}}, std::string(32, 'b')}, 0);
    mark_complete(f, sk.data);
  }
  const CheckpointReader r(dir / "p.h5");
  ASSERT_EQ(r.contents().params.size(), 1u);
  EXPECT_EQ(r.contents().params[0], rec);
  // The record names datasets the file does not have: params() refuses it, naming the record.
  const Error e = error_of([&] { (void)r.params(); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(contains(e.what(), "record of in_proj.weight")) << e.what();
  EXPECT_EQ(std::get<std::string>(r.contents().common.at("name")), "demo");
  EXPECT_EQ(std::get<double>(r.contents().common.at("lr")), 0.5);
  EXPECT_EQ(spec_at_tp(rec, 2).sections, spec.sections);
  EXPECT_EQ(spec_at_tp(rec, 1).rows(), 2 * spec.rows());
}

TEST(Format, LargeParameterRecordsAndManyCommonValuesFitAndReadInLinearTime) {
  // Far past HDF5's 64 KiB cap on compactly stored attributes; 20,000 common values took minutes
  // when each was looked up by index.
  ScratchDir dir;
  std::vector<ParamRecord> records;
  for (int i = 0; i < 3000; ++i)
    records.push_back({"decoder.layers." + std::to_string(i) + ".mixer.in_proj.weight",
                       TpAxis::rows,
                       {{"z", 64}, {"x", 64}, {"B", 32}, {"C", 32}, {"dt", 8}},
                       {4096}});
  Values common{{"config", std::string(200'000, 'c')}};
  for (int i = 0; i < 20'000; ++i) common.emplace("value." + std::to_string(i), std::int64_t{i});
  {
    io::File f = io::File::create(dir / "big.h5");
    const Skeleton sk = create_skeleton(f, {}, {CheckpointKind::global, records, common, std::string(32, 'c')}, 0);
    mark_complete(f, sk.data);
  }
  const CheckpointReader r(dir / "big.h5");
  EXPECT_EQ(r.contents().params, records);
  EXPECT_EQ(r.contents().common, common);
}

TEST(Format, ReadsWhatH5pyAddsAndRefusesWhatIsNotOurs) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::raw);
  const auto py = [&](const std::string& code) {
    return run_python("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n" + code + "\n",
                      (dir / "c.h5").string());
  };
  // A variable-length string common value (h5py's default), a group and a scalar dataset of
  // someone else's: read, skipped and named.
  ASSERT_EQ(py("f['_shardckpt/common'].attrs['note'] = 'from h5py'\nf.create_group('extra')\nf['scalar'] = 3"), 0);
  {
    const CheckpointReader r(dir / "c.h5");
    EXPECT_EQ(std::get<std::string>(r.contents().common.at("note")), "from h5py");
    EXPECT_EQ(r.datasets().size(), 2u);
    ASSERT_EQ(r.skipped().size(), 2u);
    EXPECT_EQ(r.skipped()[1].first, "scalar");
    const Error e = error_of([&] { (void)r.dataset("scalar"); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
    EXPECT_TRUE(contains(e.what(), "scalar")) << e.what();
  }
  ASSERT_EQ(py("f['_shardckpt'].attrs['format'] = 'other'"), 0);
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "c.h5"); }).code(), Errc::not_a_checkpoint);
  ASSERT_EQ(py("del f['_shardckpt'].attrs['format']"), 0);
  EXPECT_EQ(error_of([&] { CheckpointReader r(dir / "c.h5"); }).code(), Errc::not_a_checkpoint);
}

// Each damage is refused with Errc::not_a_checkpoint naming what is wrong; none may crash (the
// ASan+UBSan build runs this suite too: reading an attribute of any shape into a fixed buffer was
// a stack or heap overflow).
TEST(Format, HostileAttributesAreRefusedByName) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  struct Case {
    const char* code;
    const char* names;
  };
  const Case cases[] = {
      {"m.attrs['format_version'] = np.arange(8, dtype=np.int64)", "format_version"},
      {"m.attrs['format_version'] = np.arange(100000, dtype=np.int64)", "format_version"},
      {"m.attrs['format_version'] = np.int64(3)", "format version 3"},
      {"m.attrs['format_version'] = np.float64(2)", "format_version"},
      {"m.attrs['params'] = np.array([b'a', b'b', b'c', b'd'])", "params"},
      {"m.attrs['params'] = np.int64(4)", "params"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [], \"trailing\": []}]')",
       "params"},
      {"m.attrs['params'] = np.bytes_('[{\"key\": \"w\", \"tp_axis\": \"rows\", \"blocks\": [{\"name\": \"\", \"rows\": "
       "1e300}], \"trailing\": [4]}]')",
       "params"},
      {"m.attrs['params'] = np.bytes_('[' * 100000)", "params"},
      {"m.attrs['complete'] = np.int64(0)", "complete"},
      {"m.attrs['complete'] = 'no'", "complete"},
      {"m.attrs['complete'] = np.ones(3, dtype=np.int64)", "complete"},
      {"del m.attrs['complete']", "did not finish"},
      {"m.attrs['kind'] = 'galactic'", "kind"},
      {"m.attrs['kind'] = np.array([b'global', b'local'])", "kind"},
      {"m.attrs['checkpoint_id'] = np.int64(5)", "checkpoint_id"},
      {"m.attrs['checksums'] = 'crc32'", "checksums"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.array([1, 2], dtype=np.int64)", "iteration"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.uint64(2**64 - 1)", "iteration"},
      {"f['_shardckpt/common'].attrs['iteration'] = np.array([(1, 2.0)], dtype=[('a', 'i8'), ('b', 'f8')])[0]",
       "iteration"},
      {"del f['_shardckpt/slabs']", "slabs"},
      {"del f['_shardckpt/checksums']", "checksums"},
      {"del f['_shardckpt/checksums']\nf['_shardckpt/checksums'] = np.zeros((2, 8), dtype=np.uint64)", "checksums"},
      // Dims whose element count overflows 64 bits (HDF5 allocates nothing for unwritten chunks).
      {"f.create_dataset('huge', shape=(2**62, 2**10), chunks=(1, 1), dtype='f4')", "huge"},
  };
  for (const Case& c : cases) {
    const auto file = dir / "h.h5";
    std::filesystem::remove(file);
    write_all(file, IoMethod::raw);
    ASSERT_EQ(run_python(std::string("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n"
                                     "m = f['_shardckpt']\n") +
                             c.code + "\n",
                         file.string()),
              0)
        << c.code;
    const Error e = error_of([&] {
      const CheckpointReader r(file);
      (void)read_out(r);
      (void)r.datasets();
    });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << c.code << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), c.names)) << c.code << ": " << e.what();
  }
}

TEST(Format, HostileSlabTablesAreRefused) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  const char* cases[] = {
      "t[1, 0] = 1",               // slabs overlap
      "t[0, 1] = 1",               // a gap
      "t[1, 4] = 2**40",           // first unit past the table
      "t[0, 3] = 5",               // columns past the row
      "t[0, 0] = -1",              // before the first row
  };
  for (const char* code : cases) {
    const auto file = dir / "s.h5";
    std::filesystem::remove(file);
    write_all(file, IoMethod::raw);
    ASSERT_EQ(run_python(std::string("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n"
                                     "a = f['_shardckpt/slabs'].attrs\nt = a['w.z'].copy()\n") +
                             code + "\na['w.z'] = t\n",
                         file.string()),
              0);
    const Error e = error_of([&] {
      const CheckpointReader r(file);
      HostBuffer b = HostBuffer::zeros(DType::bf16, {6, 4});
      r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, b.mut_view());
    });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << code << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), "w.z")) << e.what();
  }
}

TEST(Format, ParamRecordsThatContradictTheDatasetsAreRefused) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  const char* cases[] = {
      R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "z", "rows": 7}], "trailing": [4]}])",
      R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "z", "rows": 6}], "trailing": [5]}])",
      R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "z", "rows": 6}, {"name": "out", "rows": 5}],
           "trailing": [4]}])",
      R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "q", "rows": 6}], "trailing": [4]}])",
  };
  for (const char* params : cases) {
    const auto file = dir / "p.h5";
    std::filesystem::remove(file);
    write_all(file, IoMethod::raw);
    ASSERT_EQ(run_python("import h5py, numpy as np, sys\nf = h5py.File(sys.argv[1], 'r+')\n"
                         "f['_shardckpt'].attrs['params'] = np.bytes_(sys.argv[2])\n",
                         file.string() + " '" + params + "'"),
              0);
    const CheckpointReader r(file);
    const Error e = error_of([&] { (void)r.params(); });
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint) << params;
    EXPECT_TRUE(contains(e.what(), "record of w")) << e.what();
  }
}

TEST(Format, CheckpointsWithoutChecksumsStillLoad) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  // A version 1 checkpoint, as shardckpt wrote them before checksums existed (and as docs/format.md
  // shows for adopting a file written by another tool).
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "w") as f:
    f["w.out"] = (np.arange(40, dtype=np.float32) * 3).reshape(5, 4, 2)
)") + version1_metadata,
                       (dir / "v1.h5").string()),
            0);
  const CheckpointReader r(dir / "v1.h5");
  EXPECT_EQ(r.version(), 1);
  EXPECT_FALSE(r.checksummed());
  EXPECT_TRUE(r.contents().id.empty());
  const auto v = read_out(r);
  for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], out_value(i)) << i;
  const VerifyReport report = verify_checkpoint(r);
  EXPECT_FALSE(report.checksummed);
  EXPECT_EQ(report.checksum_rows, 0);
}

TEST(Format, ManyChunksAreReadInLinearTime) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  // 20,000 chunks of one row each: looking up every chunk's address made this quadratic (11 s for
  // 32,768 to inspect, minutes to load); such a dataset is read through HDF5.
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], "w") as f:
    d = f.create_dataset("w", shape=(20000, 4), dtype=np.float32, chunks=(1, 4))
    d[...] = np.arange(80000, dtype=np.float32).reshape(20000, 4)
)") + version1_metadata,
                       (dir / "chunks.h5").string()),
            0);
  const CheckpointReader r(dir / "chunks.h5");
  HostBuffer b = HostBuffer::zeros(DType::f32, {20000, 4});
  r.read(r.dataset("w"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{20000, 4}, b.mut_view());
  const auto v = b.view().as<float>();
  for (std::size_t i = 0; i < v.size(); i += 997) ASSERT_EQ(v[i], static_cast<float>(i));
}

// Every seed of the fuzzer and every input it ever found crashing the reader: none may crash now.
TEST(Format, TheFuzzersInputsAreRefusedOrReadWithoutCrashing) {
  int replayed = 0;
  for (const char* sub : {"corpus", "regressions"})
    for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(SHARDCKPT_FUZZ_DIR) / sub)) {
      const std::string bytes = testing_support::file_bytes(e.path());
      testing_support::fuzz_one_input(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  EXPECT_GT(replayed, 0);
}

// What a reader checked when it opened the file is what HDF5 reads later: a file changed in place
// (not replaced) under an open reader is an error, never bytes HDF5 parses unchecked.
TEST(Format, AFileChangedInPlaceUnderAReaderIsAnErrorNeverACrash) {
  ScratchDir dir;
  const auto file = dir / "c.h5";
  write_all(file, IoMethod::raw);
  const std::string good = testing_support::file_bytes(file);
  const std::uint64_t digest = *CheckpointReader(file).seal();
  // The datasets' headers are read on first use: after the open, scribble over every byte between the
  // superblock and the seal's trailer (in place: the reader's descriptor sees the new bytes).
  const auto scribbled = [&](std::optional<std::uint64_t> trusted) {
    std::ofstream(file, std::ios::binary) << good;
    const CheckpointReader r(file, {.trusted_seal = trusted});
    {
      std::fstream f(file, std::ios::binary | std::ios::in | std::ios::out);
      f.seekp(512);
      f << std::string(good.size() - 512 - 2048, '\xAB');
    }
    return error_of([&] {
      const Dataset& d = r.dataset("w.out");
      (void)read_out(r);
      (void)d;
    });
  };
  for (const std::optional<std::uint64_t> trusted : {std::optional<std::uint64_t>{}, std::optional(digest)}) {
    const Error e = scribbled(trusted);
    EXPECT_EQ(e.code(), Errc::corrupt) << e.what();
    EXPECT_TRUE(contains(e.what(), "changed after it was sealed")) << e.what();
  }
  // Truncated in place under the reader: the same.
  std::ofstream(file, std::ios::binary) << good;
  const CheckpointReader r(file);
  std::filesystem::resize_file(file, 1024);
  EXPECT_EQ(error_of([&] { (void)read_out(r); }).code(), Errc::corrupt);
}

// Virtual datasets read as fill values where their sources are missing, and as another file's bytes
// where they are not: never read.
TEST(Format, VirtualDatasetsAreRefused) {
  if (!have_python_module("h5py")) GTEST_SKIP() << "h5py is missing";
  ScratchDir dir;
  ASSERT_EQ(run_python(std::string(R"(
import h5py, numpy as np, sys, os
d = os.path.dirname(sys.argv[1])
with h5py.File(os.path.join(d, "source.h5"), "w") as s:
    s["x"] = np.arange(8, dtype=np.float32).reshape(4, 2)
layout = h5py.VirtualLayout(shape=(4, 2), dtype=np.float32)
layout[...] = h5py.VirtualSource(os.path.join(d, "source.h5"), "x", shape=(4, 2))
with h5py.File(sys.argv[1], "w") as f:
    f.create_virtual_dataset("w", layout, fillvalue=-1)
)") + version1_metadata,
                       (dir / "virtual.h5").string()),
            0);
  const CheckpointReader r(dir / "virtual.h5");
  const Error e = error_of([&] { (void)r.dataset("w"); });
  EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(contains(e.what(), "virtual dataset")) << e.what();
}
