// Tests for shardckpt.state: state dicts, save preprocessing, loads at any layout, factory merges
// against the complete tree on the global and the local path, and errors that change nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "test_support.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::file_bytes;
using testing_support::ScratchDir;

namespace {

demo::ModelConfig small_model() {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  c.dims = {.heads = 4, .head_dim = 4, .groups = 2, .state = 4, .householder = 2};
  c.cols = 24;
  return c;
}

void save_model(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path,
                IoMethod method = IoMethod::direct) {
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    save(m.state, path, g, {method});
  });
}

// Loads at `l` on every rank and returns the number of mismatches against the pattern.
std::int64_t load_mismatches(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path) {
  std::atomic<std::int64_t> bad{0}, values{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const LoadedState s = load(path, demo::request(c, l, g.rank()), g);
    const demo::Verification v = demo::verify(c, {}, g.rank(), demo::request(c, l, g.rank()), s);
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    bad += v.mismatches;
    values += v.values;
  });
  EXPECT_GT(values.load(), 0);
  return bad.load();
}

template <class Fn>
Error error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(Errc::io, "none");
}

float as_f32(TensorView b, std::size_t i) {
  return b.dtype() == DType::bf16 ? to_f32(b.as<bf16>()[i]) : b.as<float>()[i];
}

}  // namespace

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
      const MutTensorView shard = models[static_cast<std::size_t>(r)].state.params()[p].shard.mut_view();
      auto v = shard.rows(plan.real_rows, plan.geometry.shard_rows()).as<bf16>();
      for (auto& x : v) x = to_bf16(poison);
    }
  }
  run_ranks(l.ranks(),
            [&](ProcessGroup& g) { save(models[static_cast<std::size_t>(g.rank())].state, dir / "a.h5", g); });
  const CheckpointReader reader(dir / "a.h5");
  std::int64_t total = 0;
  for (const DatasetInfo& d : reader.datasets()) {
    std::vector<std::int64_t> zero(d.shape.size(), 0);
    const std::int64_t n = element_count(d.shape);
    HostBuffer all = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    reader.read(d, zero, d.shape, all.mut_view(), {IoMethod::direct});
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
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 0;
  c.dims = {.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};  // dI 10, gS 3, nH 2 at TP 2
  c.cols = 8;
  ASSERT_EQ(demo::params(c, 2)[0].rows(), 60);
  save_model(c, {2, 2, 16, 1}, dir / "gtp.h5");
  save_model(c, {2, 1, 0, 1}, dir / "plain.h5");
  const CheckpointReader a(dir / "gtp.h5"), b(dir / "plain.h5");
  ASSERT_EQ(a.datasets().size(), b.datasets().size());
  for (const DatasetInfo& d : b.datasets()) {
    const DatasetInfo& e = a.dataset(d.key);
    ASSERT_EQ(e.shape, d.shape) << d.key;
    HostBuffer x = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    HostBuffer y = HostBuffer::zeros(d.dtype, Extents(std::span<const std::int64_t>(d.shape)));
    const std::vector<std::int64_t> zero(d.shape.size(), 0);
    b.read(d, zero, d.shape, x.mut_view(), {IoMethod::hyperslab});
    a.read(e, zero, d.shape, y.mut_view(), {IoMethod::hyperslab});
    EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.bytes()), 0) << d.key;
  }
}

TEST(Load, SaveAtGtp2LoadAtGtp1AndTheReverse) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {1, 2, 16, 1}, dir / "g2.h5");
  EXPECT_EQ(load_mismatches(c, {1, 1, 0, 1}, dir / "g2.h5"), 0);
  save_model(c, {1, 1, 0, 1}, dir / "g1.h5");
  EXPECT_EQ(load_mismatches(c, {1, 2, 16, 1}, dir / "g1.h5"), 0);
}

TEST(Load, PlainTpAndGatherSavedCheckpointsLoadAtAnyGtpAndTp2ToTp1KeepsBlockOrder) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {2, 1, 0, 1}, dir / "plain.h5");
  const demo::Layout old_layout{2, 2, 8, 1};
  std::vector<demo::RankModel> models;
  for (int r = 0; r < old_layout.ranks(); ++r) models.push_back(demo::build_rank(c, old_layout, r));
  const std::int64_t gathered = demo::gather_save(c, old_layout, models, dir / "gather.h5");
  EXPECT_GT(gathered, 0);
  for (const auto& file : {dir / "plain.h5", dir / "gather.h5"}) {
    EXPECT_EQ(load_mismatches(c, {2, 4, 8, 1}, file), 0) << file;
    EXPECT_EQ(load_mismatches(c, {1, 3, 16, 1}, file), 0) << file;  // TP 2 -> TP 1
  }
}

TEST(Load, HyperslabAndDirectPathsAgree) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {2, 2, 8, 1}, dir / "d.h5", IoMethod::direct);
  save_model(c, {2, 2, 8, 1}, dir / "h.h5", IoMethod::hyperslab);
  const demo::Layout l{1, 2, 4, 1};
  for (int r = 0; r < l.ranks(); ++r) {
    const LoadedState a = load(dir / "d.h5", demo::request(c, l, r), {IoMethod::hyperslab});
    const LoadedState b = load(dir / "h.h5", demo::request(c, l, r), {IoMethod::direct});
    for (const ParamSpec& p : demo::params(c, l.tp)) {
      const SharedBuffer& x = a.tensor(p.key);
      const SharedBuffer& y = b.tensor(p.key);
      ASSERT_EQ(x.bytes(), y.bytes());
      EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.bytes()), 0) << p.key;
    }
  }
}

// The seed's scale: 61,760 rows over GTP 64 at alignment 32, 2 columns. Rank 63 is padding-only,
// rank 62 holds 256 real rows, the others are full.
class SeedScale : public ::testing::Test {
 protected:
  static constexpr int G = 64;
  const ParamSpec fused{"mixer.in_proj.weight", {{"x", 40'000}, {"B", 21'760}}, {2}, TpAxis::rows, 1};
  const ParamSpec split{
      "mixer.out_proj.weight", plain_sections(256), {2}, TpAxis::rows, 1};  // an ordinary split factory

  static float value(std::int64_t row, std::int64_t col) { return static_cast<float>(row * 2 + col + 1); }

  struct Rank {
    SharedBuffer fused, split;
    StateDict state;
  };
  Rank build(int g) const {
    Rank r;
    ShardedParam f{fused, G, 32, {0, g}, DType::f32};
    ShardedParam s{split, G, 0, {0, g}, DType::f32};
    r.fused = SharedBuffer::zeros(DType::f32, f.shard_shape());
    r.split = SharedBuffer::zeros(DType::f32, s.shard_shape());
    fill(r.fused, f);
    fill(r.split, s);
    f.shard = r.fused;
    s.shard = r.split;
    r.state.add(f);
    r.state.add(s);
    r.state.add_common("iteration", std::int64_t{42});
    r.state.add_common("note", std::string("seed"));
    r.state.add_local("rng", std::int64_t{1000 + g});
    return r;
  }
  static void fill(const SharedBuffer& b, const ShardedParam& p) {
    const GtpGeometry geo = p.geometry();
    const RowRange real = geo.real_rows(p.coord.gtp_rank);
    auto v = b.mut_view().as<float>();
    for (std::int64_t r = 0; r < real.size(); ++r)
      for (int c = 0; c < 2; ++c) v[static_cast<std::size_t>(r * 2 + c)] = value(real.begin + r, c);
  }
  StateDict request(int g) const {
    StateDict s;
    s.add(ShardedParam{fused, G, 32, {0, g}, DType::f32});
    s.add(ShardedParam{split, G, 0, {0, g}, DType::f32});
    s.add_local("rng", std::int64_t{1000 + g});
    return s;
  }
  void check(int g, const LoadedState& s) const {
    const SharedBuffer& f = s.tensor(fused.key);
    EXPECT_EQ(f.shape(), (Extents{992, 2})) << g;
    const auto v = f.view().as<float>();
    const std::int64_t real = GtpGeometry::make(61'760, G, 32).real_count(g);
    for (std::int64_t r = 0; r < 992; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(v[static_cast<std::size_t>(r * 2 + c)], r < real ? value(g * 992 + r, c) : 0.0f)
            << "rank " << g << " row " << r;
    const auto sv = s.tensor(split.key).view().as<float>();
    ASSERT_EQ(sv.size(), 8u);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(sv[static_cast<std::size_t>(r * 2)], value(g * 4 + r, 0));
    EXPECT_EQ(std::get<std::int64_t>(s.value("iteration")), 42);
    EXPECT_EQ(std::get<std::string>(s.value("note")), "seed");
    EXPECT_EQ(std::get<std::int64_t>(s.value("rng")), 1000 + g);
  }
};

TEST_F(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheGlobalPath) {
  ScratchDir dir;
  run_ranks(G, [&](ProcessGroup& g) {
    const Rank r = build(g.rank());
    if (g.rank() == 63) {
      const SavePlan plan = prepare_save(r.state);
      // Padding-only: no piece of the fused weight.
      for (const SaveItem& i : plan.items) EXPECT_NE(i.key.rfind(fused.key, 0), 0u) << i.key;
    }
    save(r.state, dir / "seed.h5", g);
  });
  const CheckpointReader reader(dir / "seed.h5");
  EXPECT_EQ(reader.dataset("mixer.in_proj.weight.x").shape, (std::vector<std::int64_t>{40'000, 2}));
  EXPECT_EQ(reader.dataset("mixer.in_proj.weight.B").shape, (std::vector<std::int64_t>{21'760, 2}));
  for (int g : {0, 1, 40, 61, 62, 63}) check(g, load(dir / "seed.h5", request(g)));
}

TEST_F(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheLocalPath) {
  ScratchDir dir;
  for (int g : {0, 61, 62, 63}) {
    const Rank r = build(g);
    const auto file = dir / ("rank" + std::to_string(g) + ".h5");
    save_local(r.state, file);
    check(g, load_local(file, request(g)));
  }
  // Nothing of the padding-only rank's parameter reaches its local file: the load rebuilt the
  // placeholder from the request.
  const CheckpointReader r63(dir / "rank63.h5");
  EXPECT_EQ(error_of([&] { (void)r63.dataset(fused.key); }).code(), Errc::missing_key);
  for (const DatasetInfo& d : r63.datasets()) EXPECT_NE(d.key.rfind(fused.key, 0), 0u) << d.key;
  // A local checkpoint only loads at the layout that wrote it.
  StateDict other;
  other.add(ShardedParam{fused, G, 32, {0, 61}, DType::f32});
  EXPECT_EQ(error_of([&] { (void)load_local(dir / "rank0.h5", other); }).code(), Errc::missing_key);
}

TEST(Load, MambaInProjAndConv1dTakeTheGatherFreePath) {
  ScratchDir dir;
  demo::ModelConfig c = small_model();
  c.gdp_layers = 0;
  c.mamba_layers = 2;
  const auto before = materialization_count();
  save_model(c, {2, 2, 8, 1}, dir / "m.h5");
  EXPECT_EQ(materialization_count(), before);
  const CheckpointReader r(dir / "m.h5");
  EXPECT_NO_THROW((void)r.dataset("decoder.layers.1.mixer.in_proj.weight.dt"));
  EXPECT_NO_THROW((void)r.dataset("decoder.layers.1.mixer.conv1d.weight.C"));
  EXPECT_EQ(load_mismatches(c, {1, 4, 4, 1}, dir / "m.h5"), 0);
}

TEST(Errors, BadRequestsAreTypedAndChangeNothing) {
  ScratchDir dir;
  const auto c = small_model();
  save_model(c, {1, 2, 8, 1}, dir / "a.h5");
  const std::string bytes = file_bytes(dir / "a.h5");
  const ParamSpec in_proj = demo::params(c, 1)[0];

  StateDict missing;
  missing.add(ShardedParam{
      ParamSpec{"nope.weight", plain_sections(8), {24}, TpAxis::rows, 1}, 2, 8, {0, 0}, DType::bf16});
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
  EXPECT_FALSE(std::filesystem::exists(partial_path(dir / "a.h5")));
}

TEST(StateDicts, KeysAreUniqueAcrossKinds) {
  StateDict s;
  s.add_common("k", std::int64_t{1});
  EXPECT_EQ(error_of([&] { s.add_local("k", std::int64_t{2}); }).code(), Errc::invalid_argument);
  EXPECT_EQ(
      error_of([&] {
        s.add(ShardedParam{ParamSpec{"p", plain_sections(4), {}, TpAxis::rows, 1}, 2, 0, {0, 2}, DType::f32});
      }).code(),
      Errc::invalid_argument);  // GTP rank 2 of a group of 2
}
