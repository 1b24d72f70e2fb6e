// Tests for shardckpt.storage: the HDF5 format, both write and read paths, atomic commit and the
// errors a reader gives for files that are not complete checkpoints.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_support.hpp"
import shardckpt;

using namespace shardckpt;
using testing_support::ScratchDir;

namespace {

// w.out is split along dim 1 into two bands; `chunked` stores it chunked by band, as a save does.
std::vector<DatasetSpec> two_datasets(bool chunked = false) {
  return {{"w.z", DType::bf16, {6, 4}, std::nullopt, false, {}},
          {"w.out",
           DType::f32,
           {5, 4, 2},
           std::nullopt,
           false,
           chunked ? std::vector<std::int64_t>{3, 2, 2} : std::vector<std::int64_t>{}}};
}

// Writes every element of both datasets in pieces that split rows and (for w.out) dim 1.
void write_all(const std::filesystem::path& file, IoMethod method, bool chunked = false) {
  const auto infos =
      create_skeleton(file, two_datasets(chunked), {CheckpointKind::global, {}, {{"iteration", std::int64_t{7}}}});
  HostBuffer z = HostBuffer::zeros(DType::bf16, {6, 4});
  auto zv = z.mut_view().as<bf16>();
  for (std::size_t i = 0; i < zv.size(); ++i) zv[i] = to_bf16(static_cast<float>(i) + 0.5f);
  HostBuffer out = HostBuffer::zeros(DType::f32, {5, 4, 2});
  auto ov = out.mut_view().as<float>();
  for (std::size_t i = 0; i < ov.size(); ++i) ov[i] = static_cast<float>(i) * 3;
  PieceWriter w(file, method);
  w.write(infos[0], std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{2, 4}, z.view().rows(0, 2));
  w.write(infos[0], std::vector<std::int64_t>{2, 0}, std::vector<std::int64_t>{4, 4}, z.view().rows(2, 6));
  // w.out as two column bands (dim 1 split in halves), each band's rows strided in the file.
  HostBuffer left = HostBuffer::zeros(DType::f32, {5, 2, 2}), right = HostBuffer::zeros(DType::f32, {5, 2, 2});
  for (int r = 0; r < 5; ++r)
    for (int c = 0; c < 4; ++c) {
      left.mut_view().as<float>()[static_cast<std::size_t>(r * 4 + c)] = ov[static_cast<std::size_t>(r * 8 + c)];
      right.mut_view().as<float>()[static_cast<std::size_t>(r * 4 + c)] = ov[static_cast<std::size_t>(r * 8 + 4 + c)];
    }
  w.write(infos[1], std::vector<std::int64_t>{0, 0, 0}, std::vector<std::int64_t>{5, 2, 2}, left.view());
  w.write(infos[1], std::vector<std::int64_t>{0, 2, 0}, std::vector<std::int64_t>{5, 2, 2}, right.view());
  w.finish();
  mark_complete(file);
}

std::vector<float> read_f32(const CheckpointReader& r, IoMethod method) {
  const DatasetInfo& d = r.dataset("w.out");
  HostBuffer b = HostBuffer::zeros(DType::f32, {5, 4, 2});
  r.read(d, std::vector<std::int64_t>{0, 0, 0}, d.shape, b.mut_view(), method);
  auto v = b.view().as<float>();
  return {v.begin(), v.end()};
}

template <class Fn>
Errc error_code_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no error";
  return Errc::io;
}

}  // namespace

TEST(Storage, BothWritePathsProduceIdenticalFilesContiguousOrChunked) {
  ScratchDir dir;
  for (bool chunked : {false, true}) {
    const auto direct = dir / (chunked ? "direct-c.h5" : "direct.h5"),
               hyper = dir / (chunked ? "hyper-c.h5" : "hyper.h5");
    write_all(direct, IoMethod::direct, chunked);
    write_all(hyper, IoMethod::hyperslab, chunked);
    const CheckpointReader a(direct), b(hyper);
    // A band-chunked dataset is one extent per chunk: 2 row blocks (3 + 2 rows) x 2 bands.
    EXPECT_EQ(a.dataset("w.out").extents.size(), chunked ? 4u : 1u);
    for (IoMethod m : {IoMethod::direct, IoMethod::hyperslab}) {
      const auto va = read_f32(a, m), vb = read_f32(b, m);
      EXPECT_EQ(va, vb);
      for (std::size_t i = 0; i < va.size(); ++i) ASSERT_EQ(va[i], static_cast<float>(i) * 3) << i;
    }
    // Same values in the datasets: h5diff compares every element of both files.
    const std::string cmd = "h5diff " + direct.string() + " " + hyper.string() + " > /dev/null";
    if (std::system("command -v h5diff > /dev/null") == 0) EXPECT_EQ(std::system(cmd.c_str()), 0);
  }
  EXPECT_EQ(
      std::system(
          ("h5diff " + (dir / "direct.h5").string() + " " + (dir / "direct-c.h5").string() + " > /dev/null").c_str()),
      0);
}

TEST(Storage, ChunkedBandsReadAtAnyWidth) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct, true);
  const CheckpointReader r(dir / "c.h5");
  const DatasetInfo& d = r.dataset("w.out");
  // Rows 1..4 of dim-1 columns [1, 3): across both bands and both row chunks.
  HostBuffer b = HostBuffer::zeros(DType::f32, {3, 2, 2});
  r.read(d, std::vector<std::int64_t>{1, 1, 0}, std::vector<std::int64_t>{3, 2, 2}, b.mut_view(), IoMethod::direct);
  const auto v = b.view().as<float>();
  for (int row = 0; row < 3; ++row)
    for (int e = 0; e < 4; ++e)
      EXPECT_EQ(v[static_cast<std::size_t>(row * 4 + e)], static_cast<float>(((row + 1) * 8 + 2 + e) * 3))
          << row << " " << e;
}

TEST(Storage, DatasetsHaveGlobalShapesAndContiguousAddresses) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct);
  const CheckpointReader r(dir / "c.h5");
  ASSERT_EQ(r.datasets().size(), 2u);
  const DatasetInfo& z = r.dataset("w.z");
  EXPECT_EQ(z.dtype, DType::bf16);
  EXPECT_EQ(z.shape, (std::vector<std::int64_t>{6, 4}));
  EXPECT_EQ(z.extents.size(), 1u);  // contiguous: one extent, the direct path may use it
  EXPECT_EQ(std::get<std::int64_t>(r.contents().common.at("iteration")), 7);
  HostBuffer rows = HostBuffer::zeros(DType::bf16, {3, 4});
  r.read(z, std::vector<std::int64_t>{1, 0}, std::vector<std::int64_t>{3, 4}, rows.mut_view(), IoMethod::direct);
  EXPECT_EQ(to_f32(rows.view().as<bf16>()[0]), 4.5f);  // element (1, 0) = 4 + 0.5
}

TEST(Storage, H5pyReadsBf16AsFloat32) {
  if (std::system("/usr/bin/python3 -c 'import h5py' 2> /dev/null") != 0) GTEST_SKIP() << "h5py is not installed";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct);
  const std::string script =
      "import h5py,sys; d=h5py.File(sys.argv[1])['w.z']; "
      "sys.exit(0 if d.dtype.name=='float32' and d[1,0]==4.5 and d[5,3]==23.5 else 1)";
  EXPECT_EQ(std::system(("/usr/bin/python3 -c \"" + script + "\" " + (dir / "c.h5").string()).c_str()), 0);
}

TEST(Storage, ReadsRejectAWrongDtypeOrSlab) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct);
  const CheckpointReader r(dir / "c.h5");
  HostBuffer f = HostBuffer::zeros(DType::f32, {6, 4});
  EXPECT_EQ(error_code_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{0, 0}, std::vector<std::int64_t>{6, 4}, f.mut_view(),
                     IoMethod::direct);
            }),
            Errc::dtype_mismatch);
  HostBuffer b = HostBuffer::zeros(DType::bf16, {2, 4});
  EXPECT_EQ(error_code_of([&] {
              r.read(r.dataset("w.z"), std::vector<std::int64_t>{5, 0}, std::vector<std::int64_t>{2, 4}, b.mut_view(),
                     IoMethod::direct);
            }),
            Errc::invalid_argument);
  EXPECT_EQ(error_code_of([&] { (void)r.dataset("w.q"); }), Errc::missing_key);
}

TEST(Storage, FilesThatAreNotCompleteCheckpointsAreRefused) {
  ScratchDir dir;
  EXPECT_EQ(error_code_of([&] { CheckpointReader r(dir / "missing.h5"); }), Errc::not_a_checkpoint);
  std::ofstream(dir / "text.h5") << "not hdf5 at all";
  EXPECT_EQ(error_code_of([&] { CheckpointReader r(dir / "text.h5"); }), Errc::not_a_checkpoint);
  // A skeleton that was never marked complete: a save that died half-way.
  (void)create_skeleton(dir / "partial.h5", two_datasets(), {});
  try {
    CheckpointReader r(dir / "partial.h5");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_a_checkpoint);
    EXPECT_NE(std::string(e.what()).find("did not finish"), std::string::npos) << e.what();
  }
  if (std::system("/usr/bin/python3 -c 'import h5py' 2> /dev/null") == 0) {
    const std::string foreign = (dir / "foreign.h5").string();
    ASSERT_EQ(std::system(("/usr/bin/python3 -c \"import h5py; h5py.File('" + foreign + "','w')['x']=[1,2]\"").c_str()),
              0);
    EXPECT_EQ(error_code_of([&] { CheckpointReader r(foreign); }), Errc::not_a_checkpoint);
  }
}

TEST(Storage, TruncatedFileIsRefused) {
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct);
  std::filesystem::resize_file(dir / "c.h5", std::filesystem::file_size(dir / "c.h5") - 64);
  EXPECT_EQ(error_code_of([&] { CheckpointReader r(dir / "c.h5"); }), Errc::not_a_checkpoint);
}

TEST(Storage, CommitReplacesAtomicallyAndDiscardCleansUp) {
  ScratchDir dir;
  const auto final_path = dir / "ckpt.h5";
  write_all(partial_path(final_path), IoMethod::direct);
  commit(partial_path(final_path), final_path);
  EXPECT_FALSE(std::filesystem::exists(partial_path(final_path)));
  EXPECT_NO_THROW(CheckpointReader r(final_path));
  (void)create_skeleton(partial_path(final_path), two_datasets(), {});
  discard(partial_path(final_path));
  EXPECT_FALSE(std::filesystem::exists(partial_path(final_path)));
}

TEST(Storage, Hdf5ErrorsNameTheFileAndKey) {
  ScratchDir dir;
  const std::vector<DatasetSpec> dup{{"k", DType::f32, {2}, std::nullopt, false, {}},
                                     {"k", DType::f32, {2}, std::nullopt, false, {}}};
  try {
    (void)create_skeleton(dir / "d.h5", dup, {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::hdf5);
    const std::string what = e.what();
    EXPECT_NE(what.find("of key k in "), std::string::npos) << what;
    EXPECT_NE(what.find("d.h5"), std::string::npos) << what;
  }
  EXPECT_EQ(error_code_of([&] {
              (void)create_skeleton(dir / "bad.h5",
                                    std::vector<DatasetSpec>{{"a/b", DType::f32, {2}, std::nullopt, false, {}}}, {});
            }),
            Errc::invalid_argument);
}

TEST(Storage, ParamRecordsRoundTripAndPlanAtAnyTp) {
  ScratchDir dir;
  const ParamSpec spec{"in_proj.weight",
                       gdp_in_proj_sections({.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3}, 2),
                       {4},
                       TpAxis::rows,
                       2};
  const ParamRecord rec = record_of(spec);
  (void)create_skeleton(dir / "p.h5", two_datasets(),
                        {CheckpointKind::global, {rec}, {{"name", std::string("demo")}, {"lr", 0.5}}});
  mark_complete(dir / "p.h5");
  const CheckpointReader r(dir / "p.h5");
  ASSERT_EQ(r.contents().params.size(), 1u);
  EXPECT_EQ(r.contents().params[0], rec);
  EXPECT_EQ(std::get<std::string>(r.contents().common.at("name")), "demo");
  EXPECT_EQ(std::get<double>(r.contents().common.at("lr")), 0.5);
  EXPECT_EQ(spec_at_tp(rec, 2).sections, spec.sections);
  EXPECT_EQ(spec_at_tp(rec, 1).rows(), 2 * spec.rows());
}

TEST(Storage, LargeParameterRecordsAndCommonValuesFit) {
  // Far past HDF5's 64 KiB cap on compactly stored attributes.
  ScratchDir dir;
  std::vector<ParamRecord> records;
  for (int i = 0; i < 3000; ++i)
    records.push_back({"decoder.layers." + std::to_string(i) + ".mixer.in_proj.weight",
                       TpAxis::rows,
                       {{"z", 64}, {"x", 64}, {"B", 32}, {"C", 32}, {"dt", 8}},
                       {4096}});
  const std::string config(200'000, 'c');
  (void)create_skeleton(dir / "big.h5", two_datasets(), {CheckpointKind::global, records, {{"config", config}}});
  mark_complete(dir / "big.h5");
  const CheckpointReader r(dir / "big.h5");
  EXPECT_EQ(r.contents().params, records);
  EXPECT_EQ(std::get<std::string>(r.contents().common.at("config")), config);
}

TEST(Storage, ReadsWhatH5pyAddsAndRefusesWhatIsNotOurs) {
  if (std::system("/usr/bin/python3 -c 'import h5py' 2> /dev/null") != 0) GTEST_SKIP() << "h5py is not installed";
  ScratchDir dir;
  write_all(dir / "c.h5", IoMethod::direct);
  auto py = [&](const std::string& code) {
    return std::system(
        ("/usr/bin/python3 -c \"import h5py; f = h5py.File('" + (dir / "c.h5").string() + "', 'r+'); " + code + "\"")
            .c_str());
  };
  // A variable-length string common value (h5py's default) and a group of someone else's.
  ASSERT_EQ(py("f['_shardckpt/common'].attrs['note'] = 'from h5py'; f.create_group('extra')"), 0);
  {
    const CheckpointReader r(dir / "c.h5");
    EXPECT_EQ(std::get<std::string>(r.contents().common.at("note")), "from h5py");
    EXPECT_EQ(r.datasets().size(), 2u);
  }
  ASSERT_EQ(py("f['_shardckpt'].attrs['format'] = 'other'"), 0);
  EXPECT_EQ(error_code_of([&] { CheckpointReader r(dir / "c.h5"); }), Errc::not_a_checkpoint);
  ASSERT_EQ(py("del f['_shardckpt'].attrs['format']"), 0);
  EXPECT_EQ(error_code_of([&] { CheckpointReader r(dir / "c.h5"); }), Errc::not_a_checkpoint);
}
