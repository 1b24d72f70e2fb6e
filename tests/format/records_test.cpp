// Tests for shardckpt.format: parameter records and common values, round trips at any size, and
// records that contradict the datasets.
#include "support.hpp"

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
