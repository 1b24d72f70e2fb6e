// Tests for shardckpt.state: save preprocessing (pieces are views, no pad row reaches the file, the
// reference case) and errors that change nothing.
#include "support.hpp"

TEST(Save, MaterializesNothingAndTheGuardCatchesTheOldGather) {
  ScratchDir dir;
  const auto c = small_model();
  const demo::Layout l{2, 2, 8, 1};
  std::vector<demo::RankModel> models;
  for (int r = 0; r < l.ranks(); ++r) models.push_back(demo::build_rank(c, l, r));
  const auto before = materialization_count();
  run_ranks(l.ranks(),
            [&](ProcessGroup& g) { save(models[static_cast<std::size_t>(g.rank())].state, dir / "a.h5", g); });
  EXPECT_EQ(materialization_count(), before);
  // The gather-based save materializes every TP-local weight, and the guard a save holds stops it.
  const ForbidMaterialization guard;
  EXPECT_EQ(error_of([&] { (void)demo::gather_save(c, l, models, dir / "b.h5"); }).code(),
            Errc::materialization_forbidden);
}

TEST(Save, NoPadRowReachesTheFile) {
  ScratchDir dir;
  const auto c = small_model();
  const demo::Layout l{1, 4, 16, 1};
  std::vector<demo::RankModel> models;
  std::int64_t pad_rows = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    models.push_back(demo::build_rank(c, l, r));
    pad_rows += models.back().pad_rows;
  }
  ASSERT_GT(pad_rows, 0);
  // Poison every pad row with a value the pattern never has: if any pad row were written, the
  // loaded real rows would show it.
  const float poison = -12345.0f;
  for (int r = 0; r < l.ranks(); ++r) {
    const auto specs = demo::params(c, l.tp);
    for (std::size_t p = 0; p < specs.size(); ++p) {
      const RankPlan plan = plan_rank(specs[p], l.gtp, l.align, {0, r});
      const MutTensorView shard = models[static_cast<std::size_t>(r)].state.mut_shard(p).mut_view();
      auto v = shard.slice_rows(plan.real_rows, plan.geometry.shard_rows()).as<bf16>();
      for (auto& x : v) x = to_bf16(poison);
    }
  }
  run_ranks(l.ranks(),
            [&](ProcessGroup& g) { save(models[static_cast<std::size_t>(g.rank())].state, dir / "a.h5", g); });
  const CheckpointReader reader(dir / "a.h5");
  std::int64_t total = 0;
  for (const Dataset& d : reader.datasets()) {
    std::vector<std::int64_t> zero(d.shape.size(), 0);
    const std::int64_t n = element_count(d.shape);
    HostBuffer all = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    reader.read(d, zero, d.shape, all.mut_view(), {IoMethod::raw});
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_NE(as_f32(all.view(), static_cast<std::size_t>(i)), to_f32(to_bf16(poison))) << d.key << " element " << i;
      ASSERT_EQ(as_f32(all.view(), static_cast<std::size_t>(i)),
                to_f32(to_bf16(demo::pattern(d.key, static_cast<std::uint64_t>(i)))));
    }
    total += n;
  }
  EXPECT_GT(total, 0);
}

// The reference case: TP 2, GTP 2, A 16, GDP (10, 3, 2, 3): the assembled blocks equal what the
// non-GTP TP 2 save writes, key by key and value by value.
TEST(Save, ReferenceCaseEqualsThePlainTpSave) {
  ScratchDir dir;
  const demo::ModelConfig c = reference_model();
  ASSERT_EQ(demo::params(c, 2)[0].rows(), 60);
  save_model(c, {2, 2, 16, 1}, dir / "gtp.h5");
  save_model(c, {2, 1, 0, 1}, dir / "plain.h5");
  const CheckpointReader a(dir / "gtp.h5"), b(dir / "plain.h5");
  ASSERT_EQ(a.datasets().size(), b.datasets().size());
  for (const Dataset& d : b.datasets()) {
    const Dataset& e = a.dataset(d.key);
    ASSERT_EQ(e.shape, d.shape) << d.key;
    HostBuffer x = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    HostBuffer y = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    const std::vector<std::int64_t> zero(d.shape.size(), 0);
    b.read(d, zero, d.shape, x.mut_view(), {IoMethod::hyperslab});
    a.read(e, zero, d.shape, y.mut_view(), {IoMethod::hyperslab});
    EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.bytes()), 0) << d.key;
  }
}

namespace {

// The pieces the two GTP ranks of each TP rank save are views whose keys, global shapes, boxes and
// values are exactly the chunks of the non-GTP TP 2 save.
void expect_pieces_are_the_plain_tp_chunks(const std::vector<demo::RankModel>& models,
                                           const std::vector<demo::RankModel>& plain_models) {
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE(cat("TP rank ", t));
    const SavePlan chunks = prepare_save(plain_models[static_cast<std::size_t>(t)].state);
    std::map<std::string, std::vector<SaveItem>> pieces;
    for (int g = 0; g < 2; ++g)
      for (const SaveItem& i : prepare_save(models[static_cast<std::size_t>(t * 2 + g)].state).items)
        pieces[i.key].push_back(i);
    // The GTP boundary cuts V2: 2 rows on GTP rank 0, 8 on GTP rank 1.
    const auto& v2 = pieces["decoder.layers.0.mixer.in_proj.weight.V2"];
    ASSERT_EQ(v2.size(), 2u);
    EXPECT_EQ(v2[0].box.rows, (Range{t * 10, t * 10 + 2}));
    EXPECT_EQ(v2[1].box.rows, (Range{t * 10 + 2, t * 10 + 10}));
    ASSERT_EQ(pieces.size(), chunks.items.size());
    for (const SaveItem& chunk : chunks.items) {
      SCOPED_TRACE(chunk.key);
      ASSERT_TRUE(pieces.contains(chunk.key));
      auto parts = pieces[chunk.key];
      std::sort(parts.begin(), parts.end(),
                [](const SaveItem& a, const SaveItem& b) { return a.box.rows.begin < b.box.rows.begin; });
      std::int64_t row = chunk.box.rows.begin;
      for (const SaveItem& p : parts) {
        EXPECT_EQ(p.dtype, chunk.dtype);
        EXPECT_EQ(p.global_shape, chunk.global_shape);
        EXPECT_EQ(p.writes, chunk.writes);
        EXPECT_EQ(p.box.cols, chunk.box.cols);
        ASSERT_EQ(p.box.rows.begin, row);
        ASSERT_EQ(p.data.rows(), p.box.rows.size());
        const TensorView same = chunk.data.slice_rows(row - chunk.box.rows.begin, p.box.rows.end - chunk.box.rows.begin);
        ASSERT_EQ(p.data.bytes(), same.bytes());
        EXPECT_EQ(std::memcmp(p.data.data(), same.data(), same.bytes()), 0) << "rows from " << row;
        row = p.box.rows.end;
      }
      EXPECT_EQ(row, chunk.box.rows.end);
    }
  }
}

// Save, load into poisoned destinations at the same layout: each shard is rows [g L, (g + 1) L)
// of the TP-local tensor padded with zero rows.
void expect_loads_give_the_padded_tp_local_tensor(const demo::ModelConfig& c, const demo::Layout& gtp,
                                                  const std::vector<ParamSpec>& specs,
                                                  const std::vector<demo::RankModel>& models,
                                                  const std::vector<demo::RankModel>& plain_models,
                                                  const std::filesystem::path& file) {
  run_ranks(gtp.ranks(), [&](ProcessGroup& g) { save(models[static_cast<std::size_t>(g.rank())].state, file, g); });
  for (int r = 0; r < gtp.ranks(); ++r) {
    const demo::RankCoord at = demo::coord_of(gtp, r);
    StateDict dst = demo::with_destinations(demo::request(c, gtp, r));
    (void)load_into(file, dst);
    for (std::size_t p = 0; p < specs.size(); ++p) {
      SCOPED_TRACE(cat(specs[p].key, " rank ", r));
      const TensorView shard = dst.params()[p].shard.view();
      const TensorView local = plain_models[static_cast<std::size_t>(at.tp)].state.params()[p].shard.view();
      const GtpGeometry geo = GtpGeometry::make(specs[p].rows(), gtp.gtp, gtp.align);
      ASSERT_EQ(shard.rows(), geo.shard_rows());
      std::int64_t pad_rows = 0;
      for (std::int64_t row = 0; row < shard.rows(); ++row) {
        const TensorView mine = shard.slice_rows(row, row + 1);
        const std::int64_t padded_row = at.gtp * geo.shard_rows() + row;
        if (padded_row < local.rows()) {
          ASSERT_EQ(std::memcmp(mine.data(), local.slice_rows(padded_row, padded_row + 1).data(), mine.bytes()), 0) << row;
        } else {
          ++pad_rows;
          for (std::size_t b = 0; b < mine.bytes(); ++b) ASSERT_EQ(mine.data()[b], std::byte{0}) << "pad row " << row;
        }
      }
      if (p == 0) EXPECT_EQ(pad_rows, at.gtp == 1 ? 4 : 0);  // in_proj: the 4 tail rows of GTP rank 1
    }
  }
}

}  // namespace

// The reference case at the level of pieces: what the two GTP ranks of each TP rank save are
// views whose keys, global shapes, boxes and values are exactly the chunks of the non-GTP TP 2
// save; after a save and a load each shard is its part of the padded TP-local tensor.
TEST(Save, ReferenceCasePiecesAreThePlainTpChunksAndLoadsGiveThePaddedTpLocalTensor) {
  ScratchDir dir;
  const demo::ModelConfig c = reference_model();
  const demo::Layout gtp{2, 2, 16, 1}, plain{2, 1, 0, 1};
  const std::vector<ParamSpec> specs = demo::params(c, 2);
  ASSERT_EQ(specs[0].rows(), 60);
  ASSERT_EQ(GtpGeometry::make(60, 2, 16).shard_rows(), 32);
  ASSERT_EQ(GtpGeometry::make(60, 2, 16).pad(), 4);
  std::vector<demo::RankModel> models, plain_models;
  for (int r = 0; r < gtp.ranks(); ++r) models.push_back(demo::build_rank(c, gtp, r));
  for (int r = 0; r < plain.ranks(); ++r) plain_models.push_back(demo::build_rank(c, plain, r));
  expect_pieces_are_the_plain_tp_chunks(models, plain_models);
  if (HasFatalFailure()) return;  // a fatal failure among the pieces ends the test before the save
  expect_loads_give_the_padded_tp_local_tensor(c, gtp, specs, models, plain_models, dir / "ref.h5");
}

// Save preprocessing copies nothing: every piece's bytes lie inside the memory of its own shard.
TEST(Save, EveryPieceIsAViewInsideItsShard) {
  const auto c = small_model();
  const demo::Layout l{2, 2, 16, 2};
  const demo::Training adam{.adam = true, .distributed = true};
  std::int64_t pieces = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    demo::RankModel m = demo::build_rank(c, l, r, adam);
    SharedBuffer extra = SharedBuffer::zeros(DType::f32, {3, 2});
    m.state.add(ShardedTensor::of("extra", extra, {3 * l.ranks(), 2}, {3 * r, 0}));
    // The memory of the shard that each key's pieces must come from.
    std::map<std::string, TensorView> shard_of{{"extra", extra.view()}};
    for (const ShardedParam& p : m.state.params())
      for (const Block& b : blocks(p.spec)) shard_of.emplace(b.key, p.shard.view());
    const auto before = materialization_count();
    const SavePlan plan = prepare_save(m.state);
    EXPECT_EQ(materialization_count(), before);
    for (const SaveItem& i : plan.items) {
      ASSERT_TRUE(shard_of.contains(i.key)) << i.key;
      if (i.box.empty()) {  // a flat range that holds none of a piece names its block, with no bytes
        EXPECT_EQ(i.data.bytes(), 0u) << i.key;
        continue;
      }
      const TensorView shard = shard_of.at(i.key);
      EXPECT_GE(i.data.data(), shard.data()) << i.key << " on rank " << r;
      EXPECT_LE(i.data.data() + i.data.bytes(), shard.data() + shard.bytes()) << i.key << " on rank " << r;
      EXPECT_GT(i.data.bytes(), 0u) << i.key;
      ++pieces;
    }
  }
  EXPECT_GT(pieces, 0);
}

TEST(Errors, BadRequestsAreTypedAndChangeNothing) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {1, 2, 8, 1}, dir / "a.h5");
  const std::string bytes = file_bytes(dir / "a.h5");
  const ParamSpec in_proj = demo::params(c, 1)[0];

  StateDict missing;
  missing.add(ShardedParam{
      ParamSpec{"nope.weight", plain_sections(8), {24}, TpAxis::rows, 1, {}}, 2, 8, {0, 0}, DType::bf16});
  Error e = error_of([&] { (void)load(dir / "a.h5", missing); });
  EXPECT_EQ(e.code(), Errc::missing_key);
  EXPECT_NE(std::string(e.what()).find("nope.weight"), std::string::npos) << e.what();

  StateDict wrong_shape;
  ParamSpec bigger = in_proj;
  bigger.sections[0].rows += 1;
  wrong_shape.add(ShardedParam{bigger, 2, 8, {0, 0}, DType::bf16});
  e = error_of([&] { (void)load(dir / "a.h5", wrong_shape); });
  EXPECT_EQ(e.code(), Errc::shape_mismatch);
  EXPECT_NE(std::string(e.what()).find(".z: the checkpoint holds global shape"), std::string::npos) << e.what();

  StateDict wrong_dtype;
  wrong_dtype.add(ShardedParam{in_proj, 2, 8, {0, 1}, DType::f32});
  EXPECT_EQ(error_of([&] { (void)load(dir / "a.h5", wrong_dtype); }).code(), Errc::dtype_mismatch);

  EXPECT_EQ(error_of([&] { (void)load(dir / "nothing.h5", missing); }).code(), Errc::not_a_checkpoint);
  EXPECT_EQ(error_of([&] { (void)load_local(dir / "a.h5", missing); }).code(), Errc::not_a_checkpoint);
  EXPECT_TRUE(file_bytes(dir / "a.h5") == bytes);
}

TEST(Errors, AShardThatDoesNotFitItsSectionsStopsTheSaveAndKeepsTheEarlierCheckpoint) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {1, 1, 0, 1}, dir / "a.h5");
  const std::string bytes = file_bytes(dir / "a.h5");
  const ParamSpec in_proj = demo::params(c, 1)[0];
  HostBuffer wrong = HostBuffer::zeros(DType::bf16, {in_proj.rows() - 1, 24});
  StateDict s;
  ShardedParam entry{in_proj, 1, 0, {0, 0}, DType::bf16};
  entry.shard = SharedBuffer(std::move(wrong));
  s.add(std::move(entry));
  const Error e = error_of([&] { save(s, dir / "a.h5"); });
  EXPECT_EQ(e.code(), Errc::shape_mismatch);
  EXPECT_NE(std::string(e.what()).find("(TP rank 0, GTP rank 0): the shard has shape"), std::string::npos) << e.what();
  EXPECT_TRUE(file_bytes(dir / "a.h5") == bytes);
  EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(dir / "a.h5").parent_path()).empty());
}
