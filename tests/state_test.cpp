// Tests for shardckpt.state: state dicts, save preprocessing, loads at any layout, factory merges
// against the complete tree on the global and the local path, and errors that change nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::error_of;
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
                IoMethod method = IoMethod::raw) {
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

// The spec's reference layer: GDP sections (10, 3, 2, 3) at TP 2 (dI 10, gS 3, nH 2), 8 columns.
demo::ModelConfig reference_model() {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 0;
  c.dims = {.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};
  c.cols = 8;
  return c;
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

  // Save, load into poisoned destinations at the same layout: each shard is rows [g L, (g + 1) L)
  // of the TP-local tensor padded with zero rows.
  run_ranks(gtp.ranks(),
            [&](ProcessGroup& g) { save(models[static_cast<std::size_t>(g.rank())].state, dir / "ref.h5", g); });
  for (int r = 0; r < gtp.ranks(); ++r) {
    const demo::RankCoord at = demo::coord_of(gtp, r);
    StateDict dst = demo::with_destinations(demo::request(c, gtp, r));
    (void)load_into(dir / "ref.h5", dst);
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
      const TensorView shard = shard_of.at(i.key);
      EXPECT_GE(i.data.data(), shard.data()) << i.key << " on rank " << r;
      EXPECT_LE(i.data.data() + i.data.bytes(), shard.data() + shard.bytes()) << i.key << " on rank " << r;
      EXPECT_GT(i.data.bytes(), 0u) << i.key;
      ++pieces;
    }
  }
  EXPECT_GT(pieces, 0);
}

// A load allocates its destination shards and nothing else; a load into existing destinations
// allocates nothing at all (BufferStats counts every HostBuffer, SharedBuffer and engine buffer).
TEST(Load, AllocatesOnlyTheDestinationsAndLoadIntoAllocatesNothing) {
  ScratchDir dir;
  const auto c = small_model();
  const demo::Training adam{.adam = true, .distributed = true};
  const demo::Layout saved{2, 2, 8, 1}, l{1, 4, 16, 2};
  run_ranks(saved.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, saved, g.rank(), adam);
    save(m.state, dir / "a.h5", g);
    save_local(m.state, dir / ("local" + std::to_string(g.rank()) + ".h5"));
  });
  bool padding_only = false;
  for (int r = 0; r < l.ranks(); ++r) {
    SCOPED_TRACE(cat("rank ", r));
    StateDict request = demo::request(c, l, r, adam);
    std::uint64_t tensors = 0, bytes = 0;
    for (const ShardedParam& p : request.params()) {
      const std::uint64_t b = static_cast<std::uint64_t>(p.shard_shape().elements()) * dtype_size(p.dtype);
      ASSERT_GT(b, 0u) << p.spec.key;  // empty buffers are not allocations: keep every shard non-empty
      ++tensors;
      bytes += b;
      padding_only = padding_only || plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only;
    }
    BufferStats before = buffer_stats();
    {
      const LoadedState s = load(dir / "a.h5", request);
      const BufferStats after = buffer_stats();
      EXPECT_EQ(after.allocations - before.allocations, tensors);
      EXPECT_EQ(after.bytes - before.bytes, bytes);
      EXPECT_EQ(demo::verify(c, adam, r, request, s).mismatches, 0);
    }
    StateDict dst = demo::with_destinations(request);
    before = buffer_stats();
    const Values v = load_into(dir / "a.h5", dst);
    EXPECT_EQ(buffer_stats().allocations, before.allocations);
    EXPECT_EQ(buffer_stats().bytes, before.bytes);
    const demo::Verification check = demo::verify(c, adam, r, dst, v);
    EXPECT_EQ(check.mismatches, 0) << check.first_mismatch;
    EXPECT_GT(check.values, 0);
  }
  EXPECT_TRUE(padding_only);
  // The local path at the saving layout: the same.
  for (int r = 0; r < saved.ranks(); ++r) {
    StateDict dst = demo::with_destinations(demo::request(c, saved, r, adam));
    const BufferStats before = buffer_stats();
    const Values v = load_local_into(dir / ("local" + std::to_string(r) + ".h5"), dst);
    EXPECT_EQ(buffer_stats().allocations, before.allocations) << r;
    EXPECT_EQ(buffer_stats().bytes, before.bytes) << r;
    EXPECT_EQ(demo::verify(c, adam, r, dst, v).mismatches, 0) << r;
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
  save_model(c, {2, 2, 8, 1}, dir / "d.h5", IoMethod::raw);
  save_model(c, {2, 2, 8, 1}, dir / "h.h5", IoMethod::hyperslab);
  const demo::Layout l{1, 2, 4, 1};
  for (int r = 0; r < l.ranks(); ++r) {
    const LoadedState a = load(dir / "d.h5", demo::request(c, l, r), {IoMethod::hyperslab});
    const LoadedState b = load(dir / "h.h5", demo::request(c, l, r), {IoMethod::raw});
    for (const ParamSpec& p : demo::params(c, l.tp)) {
      const SharedBuffer& x = a.tensor(p.key);
      const SharedBuffer& y = b.tensor(p.key);
      ASSERT_EQ(x.bytes(), y.bytes());
      EXPECT_EQ(std::memcmp(x.view().data(), y.view().data(), x.bytes()), 0) << p.key;
    }
  }
}

// The seed's scale: 61,760 rows over GTP 64 at alignment 32, 2 columns, in bf16 and f32, written
// directly and through hyperslabs. Rank 63 is padding-only, rank 62 holds 256 real rows and 736 pad
// rows, the others are full. Besides the fused GTP weight every rank holds an ordinary split
// factory (no GTP: three blocks, TP-split over the 64 ranks), common values and local values.
class SeedScale : public ::testing::TestWithParam<std::tuple<DType, IoMethod>> {
 protected:
  static constexpr int G = 64;
  static constexpr std::int64_t L = 992;
  const ParamSpec fused{"mixer.in_proj.weight", {{"x", 40'000}, {"B", 21'760}}, {2}, TpAxis::rows, 1};
  const ParamSpec split{"mixer.gate.weight", {{"a", 3}, {"b", 5}, {"c", 2}}, {2}, TpAxis::rows, G};

  DType dtype() const { return std::get<0>(GetParam()); }
  IoMethod method() const { return std::get<1>(GetParam()); }
  ShardedParam fused_param(int g) const { return {fused, G, 32, {0, g}, dtype()}; }
  ShardedParam split_param(int g) const { return {split, 1, 0, {g, 0}, dtype()}; }
  static std::int64_t real_rows(int g) { return GtpGeometry::make(61'760, G, 32).real_count(g); }

  // Element codes: non-zero, exact in f32, and a bf16's bits as they are, so that every element
  // is compared exactly (a bf16 rounding would hide a shifted row).
  static std::uint32_t code(std::int64_t i) { return static_cast<std::uint32_t>(i % 65'521) + 1; }
  static std::uint32_t fused_code(std::int64_t row, std::int64_t col) { return code(row * 2 + col); }
  static std::uint32_t split_code(int g, std::int64_t row, std::int64_t col) {
    return code(500'000 + (g * 10 + row) * 2 + col);
  }
  static void put(MutTensorView v, std::size_t i, std::uint32_t x) {
    if (v.dtype() == DType::f32)
      v.as<float>()[i] = static_cast<float>(x);
    else
      v.as<bf16>()[i] = bf16::from_bits(static_cast<std::uint16_t>(x));
  }
  static std::uint32_t get(TensorView v, std::size_t i) {
    return v.dtype() == DType::f32 ? static_cast<std::uint32_t>(v.as<float>()[i]) : v.as<bf16>()[i].bits();
  }

  struct Rank {
    SharedBuffer fused, split;
    StateDict state;
  };
  Rank build(int g) const {
    Rank r;
    ShardedParam f = fused_param(g), s = split_param(g);
    r.fused = SharedBuffer::zeros(dtype(), f.shard_shape());
    r.split = SharedBuffer::zeros(dtype(), s.shard_shape());
    for (std::int64_t row = 0; row < real_rows(g); ++row)
      for (int c = 0; c < 2; ++c)
        put(r.fused.mut_view(), static_cast<std::size_t>(row * 2 + c), fused_code(g * L + row, c));
    for (std::int64_t row = 0; row < 10; ++row)
      for (int c = 0; c < 2; ++c) put(r.split.mut_view(), static_cast<std::size_t>(row * 2 + c), split_code(g, row, c));
    f.shard = r.fused;
    s.shard = r.split;
    r.state.add(f);
    r.state.add(s);
    r.state.add_common("iteration", std::int64_t{42});
    r.state.add_common("note", std::string("seed"));
    r.state.add_common("lr", 0.25);
    r.state.add_local("rng", std::int64_t{1000 + g});
    r.state.add_local("host", "node-" + std::to_string(g));
    return r;
  }
  StateDict request(int g, bool split_too = true) const {
    StateDict s;
    s.add(fused_param(g));
    if (split_too) s.add(split_param(g));
    s.add_local("rng", std::int64_t{1000 + g});
    s.add_local("host", "node-" + std::to_string(g));
    return s;
  }
  // The request with destinations whose every byte is 0xff: a load must write every one of them.
  StateDict poisoned(int g, std::vector<SharedBuffer>& keep) const {
    StateDict s;
    for (ShardedParam p : {fused_param(g), split_param(g)}) {
      keep.push_back(SharedBuffer::uninitialized(p.dtype, p.shard_shape()));
      std::memset(keep.back().mut_view().data(), 0xff, keep.back().bytes());
      p.shard = keep.back();
      s.add(std::move(p));
    }
    s.add_local("rng", std::int64_t{1000 + g});
    s.add_local("host", "node-" + std::to_string(g));
    return s;
  }

  // The fused shard: its real rows as saved and zero pad rows, (992, 2) of the requested dtype in
  // host memory (for the padding-only rank too).
  void check_fused(int g, TensorView f) const {
    ASSERT_EQ(f.shape(), (Extents{L, 2})) << g;
    ASSERT_EQ(f.dtype(), dtype()) << g;
    ASSERT_EQ(f.space(), MemorySpace::host()) << g;
    for (std::int64_t r = 0; r < L; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(get(f, static_cast<std::size_t>(r * 2 + c)), r < real_rows(g) ? fused_code(g * L + r, c) : 0u)
            << "rank " << g << " row " << r << " column " << c;
  }
  void check_split(int g, TensorView s) const {
    ASSERT_EQ(s.shape(), (Extents{10, 2})) << g;
    ASSERT_EQ(s.dtype(), dtype()) << g;
    for (std::int64_t r = 0; r < 10; ++r)
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(get(s, static_cast<std::size_t>(r * 2 + c)), split_code(g, r, c)) << "rank " << g << " row " << r;
  }
  static void check_values(int g, const Values& v) {
    EXPECT_EQ(v.size(), 5u) << g;
    EXPECT_EQ(std::get<std::int64_t>(v.at("iteration")), 42);
    EXPECT_EQ(std::get<std::string>(v.at("note")), "seed");
    EXPECT_EQ(std::get<double>(v.at("lr")), 0.25);
    EXPECT_EQ(std::get<std::int64_t>(v.at("rng")), 1000 + g);
    EXPECT_EQ(std::get<std::string>(v.at("host")), "node-" + std::to_string(g));
  }
  void check(int g, const LoadedState& s) const {
    check_fused(g, s.tensor(fused.key).view());
    check_split(g, s.tensor(split.key).view());
    check_values(g, s.values());
  }
  void check(int g, const StateDict& filled, const Values& values) const {
    check_fused(g, filled.params()[0].shard.view());
    check_split(g, filled.params()[1].shard.view());
    check_values(g, values);
  }

  // Saves all 64 ranks as one global checkpoint; the padding-only rank has no piece of the fused weight.
  void save_global(const std::filesystem::path& path) const {
    run_ranks(G, [&](ProcessGroup& g) {
      const Rank r = build(g.rank());
      const SavePlan plan = prepare_save(r.state);
      std::int64_t fused_items = 0;
      for (const SaveItem& i : plan.items) fused_items += i.key.starts_with(fused.key);
      EXPECT_EQ(fused_items, g.rank() == 63 ? 0 : g.rank() == 40 ? 2 : 1) << g.rank();  // rank 40 holds x and B
      save(r.state, path, g, {method()});
    });
  }
};

INSTANTIATE_TEST_SUITE_P(DtypesAndWriteMethods, SeedScale,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f32),
                                            ::testing::Values(IoMethod::raw, IoMethod::hyperslab)),
                         [](const auto& info) {
                           return cat(dtype_name(std::get<0>(info.param)), "_",
                                      std::get<1>(info.param) == IoMethod::raw ? "raw" : "hyperslab");
                         });

TEST_P(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheGlobalPath) {
  ScratchDir dir;
  save_global(dir / "seed.h5");
  // Every element of every dataset is the saved one: the blocks at their plain-TP global shapes.
  const CheckpointReader reader(dir / "seed.h5");
  ASSERT_EQ(reader.datasets().size(), 5u);
  const auto read_all = [&](const std::string& key, std::vector<std::int64_t> shape) {
    const Dataset& d = reader.dataset(key);
    EXPECT_EQ(d.shape, shape) << key;
    EXPECT_EQ(d.dtype, dtype()) << key;
    HostBuffer all = HostBuffer::zeros(dtype(), Extents(std::span<const std::int64_t>(shape)));
    reader.read(d, std::vector<std::int64_t>(shape.size(), 0), shape, all.mut_view(), {method()});
    return all;
  };
  const HostBuffer x = read_all("mixer.in_proj.weight.x", {40'000, 2});
  const HostBuffer b = read_all("mixer.in_proj.weight.B", {21'760, 2});
  for (std::int64_t r = 0; r < 61'760; ++r)
    for (int c = 0; c < 2; ++c)
      ASSERT_EQ(r < 40'000 ? get(x.view(), static_cast<std::size_t>(r * 2 + c))
                           : get(b.view(), static_cast<std::size_t>((r - 40'000) * 2 + c)),
                fused_code(r, c))
          << "row " << r;
  std::int64_t first = 0;
  for (const Section& s : split.sections) {
    const HostBuffer block = read_all(block_key(split.key, s.name), {s.rows * G, 2});
    for (int g = 0; g < G; ++g)
      for (std::int64_t r = 0; r < s.rows; ++r)
        for (int c = 0; c < 2; ++c)
          ASSERT_EQ(get(block.view(), static_cast<std::size_t>((g * s.rows + r) * 2 + c)), split_code(g, first + r, c))
              << s.name << " rank " << g;
    first += s.rows;
  }
  // Loads of full, partly padded and padding-only ranks, into memory the load allocates and into
  // poisoned destinations.
  for (int g : {0, 1, 40, 61, 62, 63}) check(g, load(dir / "seed.h5", request(g), {method()}));
  for (int g : {0, 62, 63}) {
    std::vector<SharedBuffer> keep;
    StateDict dst = poisoned(g, keep);
    const Values v = load_into(dir / "seed.h5", dst, {method()});
    check(g, dst, v);
  }
}

TEST_P(SeedScale, FullPartlyPaddedAndPaddingOnlyRanksRoundTripOnTheLocalPath) {
  ScratchDir dir;
  for (int g : {0, 40, 61, 62, 63}) {
    const Rank r = build(g);
    const auto file = dir / ("rank" + std::to_string(g) + ".h5");
    save_local(r.state, file, method());
    check(g, load_local(file, request(g), {method()}));
    std::vector<SharedBuffer> keep;
    StateDict dst = poisoned(g, keep);
    const Values v = load_local_into(file, dst, {method()});
    check(g, dst, v);
  }
  // A local checkpoint only loads at the layout that wrote it.
  StateDict other;
  other.add(ShardedParam{fused, G, 32, {0, 61}, dtype()});
  EXPECT_EQ(error_of([&] { (void)load_local(dir / "rank0.h5", other); }).code(), Errc::missing_key);
}

// The padding-only rank's parameter never reaches a file; a load rebuilds its placeholder from the
// request as a local value and merges every factory against the complete tree (loaded pieces,
// common values, local values). Merging before the local values are in the tree finds no key for
// the padding-only rank (the peer system's "Different dict keys encountered"), on either path.
TEST_P(SeedScale, PaddingOnlyRankIsRebuiltFromTheRequestAndMergedAgainstTheCompleteTree) {
  ScratchDir dir;
  const Rank r = build(63);
  save_local(r.state, dir / "rank63.h5", method());
  const CheckpointReader local(dir / "rank63.h5");
  EXPECT_EQ(error_of([&] { (void)local.dataset(fused.key); }).code(), Errc::missing_key);
  for (const Dataset& d : local.datasets()) {
    EXPECT_FALSE(d.key.starts_with(fused.key)) << d.key;
    ASSERT_TRUE(d.placement.has_value()) << d.key;
    EXPECT_FALSE(d.placement->key.starts_with(fused.key)) << d.key;
  }
  EXPECT_EQ(local.datasets().size(), 3u);  // the split factory's blocks alone
  save_global(dir / "seed.h5");

  for (const bool local_path : {true, false}) {
    SCOPED_TRACE(local_path ? "local path" : "global path");
    const auto file = dir / (local_path ? "rank63.h5" : "seed.h5");
    const auto load_at = [&](const StateDict& request) {
      return local_path ? load_local(file, request, {method()}) : load(file, request, {method()});
    };
    const auto load_into_at = [&](StateDict& state) {
      return local_path ? load_local_into(file, state, {method()}) : load_into(file, state, {method()});
    };
    try {
      // Nothing but the padding-only parameter: its key exists only as the placeholder.
      const LoadedState alone = load_at(request(63, false));
      check_fused(63, alone.tensor(fused.key).view());
      EXPECT_EQ(std::get<std::int64_t>(alone.value("rng")), 1063);
      // With the other factory, into memory the load allocates and into poisoned destinations.
      check(63, load_at(request(63)));
      std::vector<SharedBuffer> keep;
      StateDict dst = poisoned(63, keep);
      check(63, dst, load_into_at(dst));
    } catch (const Error& e) {  // reported for each path
      ADD_FAILURE() << errc_name(e.code()) << ": " << e.what();
    }
  }
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
  EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(dir / "a.h5").parent_path()).empty());
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

// Loads read tensor data through the page cache unless asked to read around it, and either way
// deliver the same values.
TEST(Load, ReadsAroundThePageCacheOnlyWhenAskedTo) {
  ScratchDir dir;
  demo::ModelConfig c;
  c.cols = 1024;
  const demo::Layout l{1, 2, 8, 1};
  run_ranks(l.ranks(), [&](ProcessGroup& g) { save(demo::build_rank(c, l, g.rank()).state, dir / "a.h5", g); });
  if (!testing_support::direct_io_possible(dir / "a.h5")) GTEST_SKIP() << "this file system refuses O_DIRECT";
  const std::size_t pages = (std::filesystem::file_size(dir / "a.h5") + 4095) / 4096;
  ASSERT_GT(pages, 1000u);  // tensor data, not metadata, makes up the file
  StateDict request = demo::request(c, l, 0), model = demo::with_destinations(request);
  const auto check = [&](const demo::Verification& v) {
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
  };
  // Rank 0 reads half of the file's tensor bytes.
  for (const bool bypass : {false, true}) {
    SCOPED_TRACE(bypass ? "around the page cache" : "through the page cache");
    const LoadOptions options{.bypass_page_cache = bypass};
    const auto expect_cached = [&](std::size_t cached) {
      if (bypass)
        EXPECT_LT(cached, pages / 4) << "of " << pages;
      else
        EXPECT_GT(cached, pages / 3) << "of " << pages;
    };
    expect_cached(testing_support::cached_pages_after(dir / "a.h5", [&] {
      check(demo::verify(c, {}, 0, model, load_into(dir / "a.h5", model, options)));
    }));
    expect_cached(testing_support::cached_pages_after(dir / "a.h5", [&] {
      check(demo::verify(c, {}, 0, request, load(dir / "a.h5", request, options)));
    }));
  }
}

// A load checks every destination before it reads a byte: a read-only entry, or two entries whose
// memory overlaps, is a typed error naming the keys, and nothing is loaded into the others.
TEST(Load, ReadOnlyOrOverlappingDestinationsAreRefusedBeforeAnyRead) {
  ScratchDir dir;
  {
    StateDict s;
    SharedBuffer a = SharedBuffer::zeros(DType::f32, {4, 2}), b = SharedBuffer::zeros(DType::f32, {4, 2});
    for (float& x : a.mut_view().as<float>()) x = 1;
    for (float& x : b.mut_view().as<float>()) x = 2;
    s.add(ShardedTensor::of("a", a, {4, 2}, {0, 0}));
    s.add(ShardedTensor::of("b", b, {4, 2}, {0, 0}));
    save(s, dir / "c.h5");
  }
  SharedBuffer first = SharedBuffer::zeros(DType::f32, {4, 2});
  const SharedBuffer second = SharedBuffer::zeros(DType::f32, {4, 2});
  StateDict read_only;
  read_only.add(ShardedTensor::of("a", first, {4, 2}, {0, 0}));
  read_only.add(ShardedTensor::of("b", TensorRef::read_only(second), {4, 2}, {0, 0}));
  const Error e = error_of([&] { (void)load_into(dir / "c.h5", read_only); });
  EXPECT_EQ(e.code(), Errc::invalid_argument);
  EXPECT_TRUE(testing_support::contains(e.what(), "tensor b")) << e.what();
  for (float x : first.view().as<float>()) EXPECT_EQ(x, 0.0f);  // not even `a` was read
  // Two entries over the same memory (the second half of one is the first half of the other).
  std::vector<float> memory(12, -1);
  StateDict overlapping;
  overlapping.add(ShardedTensor::of(
      "a", unchecked_borrow(MutTensorView::unchecked(memory.data(), DType::f32, {4, 2})), {4, 2}, {0, 0}));
  overlapping.add(ShardedTensor::of(
      "b", unchecked_borrow(MutTensorView::unchecked(memory.data() + 4, DType::f32, {4, 2})), {4, 2}, {0, 0}));
  const Error o = error_of([&] { (void)load_into(dir / "c.h5", overlapping); });
  EXPECT_EQ(o.code(), Errc::invalid_argument);
  EXPECT_TRUE(testing_support::contains(o.what(), "destinations of a and b share 16 bytes")) << o.what();
  EXPECT_EQ(memory, std::vector<float>(12, -1));
}
