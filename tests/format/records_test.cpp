// Tests for the storage module's format partition (shardckpt.storage:format): parameter records and
// common values, round trips at any size, and records that contradict the datasets.
#include "support.hpp"

TEST(Format, ParamRecordsRoundTripAndPlanAtAnyTp) {
  ScratchDir dir;
  const SsmDims d{.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};
  const ParamSpec spec{"in_proj.weight", gdp_in_proj_sections(d, 2), {4}, TpAxis::rows, 2, ssm_divisors(d)};
  const ParamRecord rec = record_of(spec);
  ASSERT_EQ(rec.divisors, ssm_divisors(d));
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
                       {4096},
                       {{"heads", 8}, {"groups", 2}}});
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

TEST(Format, RecordsCarryTheirDivisorsAndRecordsWithoutThemStillParse) {
  const ParamRecord fused{"in_proj.weight", TpAxis::rows, {{"z", 16}, {"b0", 8}}, {4}, {{"heads", 8}, {"groups", 4}}};
  const ParamRecord plain{"norm.weight", TpAxis::replicated, {{"", 4}}, {}, {}};
  const std::string text = records_json({fused, plain});
  EXPECT_TRUE(contains(text, R"("divisors":[{"count":8,"name":"heads"},{"count":4,"name":"groups"}])")) << text;
  EXPECT_EQ(parse_records(text), (std::vector<ParamRecord>{fused, plain}));
  // A record without divisors writes none: what checkpoints written before them hold, and read.
  EXPECT_EQ(text.find("divisors"), text.rfind("divisors")) << text;
  const auto old =
      parse_records(R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "z", "rows": 8}], "trailing": [4]}])");
  ASSERT_EQ(old.size(), 1u);
  EXPECT_TRUE(old[0].divisors.empty());
  EXPECT_EQ(spec_at_tp(old[0], 8).rows(), 1);
  EXPECT_EQ(error_of([&] { (void)spec_at_tp(fused, 3); }).what(),
            std::string("in_proj.weight: heads (8) does not divide by TP 3"));
}

TEST(Format, HostileDivisorsAreRefused) {
  const std::string head =
      R"([{"key": "w", "tp_axis": "rows", "blocks": [{"name": "z", "rows": 8}], "trailing": [4], "divisors": )";
  for (const char* divisors : {R"([{"name": "heads", "count": -8}])", R"([{"name": "heads", "count": 0}])",
                               R"([{"name": "heads", "count": 8.5}])", R"([{"name": "heads", "count": "8"}])",
                               R"([{"name": "heads", "count": 1e300}])",
                               R"([{"name": "heads", "count": 18446744073709551615}])",
                               R"([{"name": "heads", "count": 8}, {"name": "heads", "count": 4}])",
                               R"([{"name": "", "count": 8}])", R"([{"name": 7, "count": 8}])", R"([{"count": 8}])",
                               R"([8])", R"({"heads": 8})", R"("heads")", "null",
                               R"([[{"name": "heads", "count": 8}]])"}) {
    const Error e = error_of([&] { (void)parse_records(head + divisors + "}]"); });
    EXPECT_EQ(e.code(), Errc::invalid_argument) << divisors;
    EXPECT_TRUE(contains(e.what(), "not valid parameter records")) << e.what();
  }
}
