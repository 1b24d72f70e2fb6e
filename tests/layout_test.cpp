// Tests for shardckpt.layout: geometry, fused layouts, plans and tiling validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>
import shardckpt.core;
import shardckpt.layout;

using namespace shardckpt;

namespace shardckpt {
// Boxes in failure messages as rows x elements.
void PrintTo(const Box& b, std::ostream* out) {
  *out << "rows [" << b.rows.begin << ", " << b.rows.end << ") x elements [" << b.cols.begin << ", " << b.cols.end
       << ")";
}
}  // namespace shardckpt

namespace {

// A claim on the slab at `offset` with extent `count`.
Claim claim(std::string key, DType dtype, std::vector<std::int64_t> shape, std::vector<std::int64_t> offset,
            std::vector<std::int64_t> count, int rank, bool writes) {
  const Box box = footprint(key, shape, offset, count);
  return {std::move(key), dtype, std::move(shape), box, rank, writes};
}

// Every claim of every (tp, gtp) rank of one parameter, as the save exchanges them.
std::vector<Claim> all_claims(const ParamSpec& spec, std::int64_t gtp, std::int64_t align) {
  std::vector<Claim> claims;
  for (int t = 0; t < spec.tp; ++t)
    for (int g = 0; g < gtp; ++g) {
      RankPlan plan = plan_rank(spec, gtp, align, {t, g});
      for (const Piece& p : plan.pieces)
        claims.push_back(claim(p.key, DType::bf16, p.global_shape, p.global_offset, p.count,
                               static_cast<int>(t * gtp + g), plan.main_replica));
    }
  return claims;
}

// Global value of element (row, col) of a block: distinct for every key and element.
double value_of(const std::string& key, std::int64_t row, std::int64_t col) {
  return static_cast<double>(std::hash<std::string>{}(key) % 1000) * 1e6 + row * 1000 + col;
}

// Simulates a save: builds each rank's padded shard from the global blocks (the TP-local weight
// is the TP slice of every block, stacked in section order), then writes every piece into an
// in-memory "file" at its global offset. Returns key -> row-major values; NaN marks unwritten.
std::map<std::string, std::vector<double>> simulate_save(const ParamSpec& spec, std::int64_t gtp, std::int64_t align) {
  const std::int64_t C = spec.row_elems();
  std::map<std::string, std::vector<double>> file;
  for (const Block& b : blocks(spec))
    file[b.key].assign(static_cast<std::size_t>(element_count(b.global_shape)), std::nan(""));
  for (int t = 0; t < spec.tp; ++t) {
    // TP-local weight of rank t.
    std::vector<double> local(static_cast<std::size_t>(spec.rows() * C));
    for (const Block& b : blocks(spec))
      for (std::int64_t r = b.local_rows.begin; r < b.local_rows.end; ++r)
        for (std::int64_t c = 0; c < C; ++c) {
          const std::int64_t grow =
              spec.tp_axis == TpAxis::rows ? t * b.local_rows.size() + r - b.local_rows.begin : r - b.local_rows.begin;
          const std::int64_t gcol = spec.tp_axis == TpAxis::cols ? t * C + c : c;
          local[static_cast<std::size_t>(r * C + c)] = value_of(b.key, grow, gcol);
        }
    for (int g = 0; g < gtp; ++g) {
      RankPlan plan = plan_rank(spec, gtp, align, {t, g});
      if (!plan.main_replica) continue;
      const std::int64_t L = plan.geometry.shard_rows();
      std::vector<double> shard(static_cast<std::size_t>(L * C), 0.0);
      for (std::int64_t r = 0; r < plan.real_rows; ++r)
        for (std::int64_t c = 0; c < C; ++c)
          shard[static_cast<std::size_t>(r * C + c)] = local[static_cast<std::size_t>((g * L + r) * C + c)];
      for (const Piece& p : plan.pieces) {
        EXPECT_LE(p.shard_row + p.rows, plan.real_rows) << "piece reaches into pad rows: " << p.key;
        const std::int64_t gcols = p.global_shape.size() > 1 ? C * (spec.tp_axis == TpAxis::cols ? spec.tp : 1) : 1;
        // Dim 1 is the outermost trailing dim: offset o in it starts at flat element o * (C / dim 1).
        const std::int64_t col0 = spec.tp_axis == TpAxis::cols ? p.global_offset[1] * (C / spec.trailing[0]) : 0;
        auto& dst = file[p.key];
        for (std::int64_t r = 0; r < p.rows; ++r)
          for (std::int64_t c = 0; c < C; ++c) {
            auto& cell = dst[static_cast<std::size_t>((p.global_offset[0] + r) * gcols + col0 + c)];
            EXPECT_TRUE(std::isnan(cell)) << "element written twice in " << p.key;
            cell = shard[static_cast<std::size_t>((p.shard_row + r) * C + c)];
          }
      }
    }
  }
  return file;
}

}  // namespace

TEST(GtpGeometry, SeedExampleHasFullPartlyPaddedAndPaddingOnlyRanks) {
  const GtpGeometry g = GtpGeometry::make(61'760, 64, 32);
  EXPECT_EQ(g.block(), 2'048);
  EXPECT_EQ(g.pad(), 1'728);
  EXPECT_EQ(g.shard_rows(), 992);
  for (int r = 0; r <= 61; ++r) EXPECT_EQ(g.real_count(r), 992) << r;
  EXPECT_EQ(g.real_count(62), 256);
  EXPECT_EQ(g.real_rows(62), (Range{61'504, 61'760}));
  EXPECT_TRUE(g.padding_only(63));
  EXPECT_FALSE(g.padding_only(62));
  EXPECT_EQ(g.padding_only_ranks(), 1);
}

TEST(GtpGeometry, AlignmentZeroMeansNoPadAndNeedsDivisibleRows) {
  const GtpGeometry g = GtpGeometry::make(64, 4, 0);
  EXPECT_EQ(g.pad(), 0);
  EXPECT_EQ(g.shard_rows(), 16);
  try {
    (void)GtpGeometry::make(62, 4, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::layout);
    EXPECT_NE(std::string(e.what()).find("62"), std::string::npos) << e.what();
  }
}

TEST(GtpGeometry, RejectsNonsense) {
  EXPECT_THROW((void)GtpGeometry::make(0, 4, 16), Error);
  EXPECT_THROW((void)GtpGeometry::make(10, 0, 16), Error);
  EXPECT_THROW((void)GtpGeometry::make(10, 2, -1), Error);
}

TEST(FusedLayouts, GdpInProjExampleHas60RowsIn12Blocks) {
  // dI = 10, gS = 3, nH = 2, H = 3 at TP 1.
  const auto s = gdp_in_proj_sections({.heads = 2, .head_dim = 5, .groups = 1, .state = 3, .householder = 3}, 1);
  ASSERT_EQ(s.size(), 12u);
  const std::vector<std::string> names{"z", "V0", "V1", "V2", "K0", "K1", "K2", "Q", "b0", "b1", "b2", "a"};
  const std::vector<std::int64_t> rows{10, 10, 10, 10, 3, 3, 3, 3, 2, 2, 2, 2};
  std::int64_t total = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].name, names[i]);
    EXPECT_EQ(s[i].rows, rows[i]) << names[i];
    total += s[i].rows;
  }
  EXPECT_EQ(total, 60);
}

TEST(FusedLayouts, MambaAndConvLayoutsFollowTheSpec) {
  const SsmDims d{.heads = 8, .head_dim = 4, .groups = 2, .state = 16, .householder = 2};
  const auto m = mamba_in_proj_sections(d, 2);  // dI 16, gS 16, nH 4
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0], (Section{"z", 16}));
  EXPECT_EQ(m[1], (Section{"x", 16}));
  EXPECT_EQ(m[2], (Section{"B", 16}));
  EXPECT_EQ(m[3], (Section{"C", 16}));
  EXPECT_EQ(m[4], (Section{"dt", 4}));
  const auto mc = mamba_conv1d_sections(d, 2);
  ASSERT_EQ(mc.size(), 3u);
  EXPECT_EQ(mc[0], (Section{"x", 16}));
  const auto gc = gdp_conv1d_sections(d, 2);  // V0 V1 K0 K1 Q
  ASSERT_EQ(gc.size(), 5u);
  EXPECT_EQ(gc[0], (Section{"V0", 16}));
  EXPECT_EQ(gc[2], (Section{"K0", 16}));
  EXPECT_EQ(gc[4], (Section{"Q", 16}));
}

TEST(FusedLayouts, HeadsThatDoNotDivideByTpAreRejected) {
  try {
    (void)gdp_in_proj_sections({.heads = 3, .head_dim = 4, .groups = 2, .state = 4, .householder = 1}, 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::layout);
    EXPECT_NE(std::string(e.what()).find("heads (3) does not divide by TP 2"), std::string::npos) << e.what();
  }
}

TEST(Plan, BlocksHaveThePlainTpKeysAndGlobalShapes) {
  const SsmDims d{.heads = 4, .head_dim = 2, .groups = 2, .state = 3};
  ParamSpec spec{"in_proj.weight", mamba_in_proj_sections(d, 2), {5}, TpAxis::rows, 2, ssm_divisors(d)};
  const auto b = blocks(spec);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_EQ(b[0].key, "in_proj.weight.z");
  EXPECT_EQ(b[0].global_shape, (std::vector<std::int64_t>{8, 5}));
  EXPECT_EQ(b[4].key, "in_proj.weight.dt");
  EXPECT_EQ(b[4].global_shape, (std::vector<std::int64_t>{4, 5}));
  ParamSpec plain{"out_proj.weight", plain_sections(6), {3}, TpAxis::cols, 4, {}};
  const auto pb = blocks(plain);
  ASSERT_EQ(pb.size(), 1u);
  EXPECT_EQ(pb[0].key, "out_proj.weight");
  EXPECT_EQ(pb[0].global_shape, (std::vector<std::int64_t>{6, 12}));
}

// The spec's reference case: TP 2, GTP 2, A 16, GDP (dI, gS, nH, H) = (10, 3, 2, 3).
TEST(Plan, ReferenceCaseGtpBoundaryCutsV2AndMatchesPlainTp) {
  const SsmDims d{.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};
  ParamSpec spec{"in_proj.weight", gdp_in_proj_sections(d, 2), {4}, TpAxis::rows, 2, ssm_divisors(d)};
  ASSERT_EQ(spec.rows(), 60);
  const RankPlan r0 = plan_rank(spec, 2, 16, {0, 0});
  EXPECT_EQ(r0.geometry.shard_rows(), 32);
  EXPECT_EQ(r0.geometry.pad(), 4);
  // Rank 0 holds rows [0, 32): z, V0, V1 and the first two rows of V2.
  ASSERT_EQ(r0.pieces.size(), 4u);
  EXPECT_EQ(r0.pieces[3].key, "in_proj.weight.V2");
  EXPECT_EQ(r0.pieces[3].rows, 2);
  EXPECT_EQ(r0.pieces[3].shard_row, 30);
  const RankPlan r1 = plan_rank(spec, 2, 16, {1, 1});
  EXPECT_EQ(r1.pieces.front().key, "in_proj.weight.V2");
  EXPECT_EQ(r1.pieces.front().rows, 8);
  EXPECT_EQ(r1.pieces.front().shard_row, 0);
  EXPECT_EQ(r1.pieces.front().global_offset, (std::vector<std::int64_t>{12, 0}));  // t*s_j + lo - S_j = 10 + 2
  EXPECT_EQ(r1.real_rows, 28);

  const auto gtp = simulate_save(spec, 2, 16);
  const auto plain = simulate_save(spec, 1, 0);
  ASSERT_EQ(gtp.size(), 12u);
  for (const auto& [key, values] : plain) {
    ASSERT_TRUE(gtp.contains(key)) << key;
    const auto& other = gtp.at(key);
    ASSERT_EQ(other.size(), values.size()) << key;
    for (std::size_t i = 0; i < values.size(); ++i) {
      ASSERT_FALSE(std::isnan(values[i])) << key << " element " << i << " never written";
      ASSERT_EQ(other[i], values[i]) << key << " element " << i;
    }
  }
  EXPECT_NO_THROW(validate_claims(all_claims(spec, 2, 16)));
}

TEST(Plan, RowParallelWeightPiecesLandAtTheirColumns) {
  ParamSpec spec{"out_proj.weight", plain_sections(40), {6}, TpAxis::cols, 2, {}};
  const RankPlan p = plan_rank(spec, 4, 4, {1, 3});  // L = 12 (48 padded rows), rank 3 holds [36, 40)
  ASSERT_EQ(p.pieces.size(), 1u);
  EXPECT_EQ(p.pieces[0].global_offset, (std::vector<std::int64_t>{36, 6}));
  EXPECT_EQ(p.pieces[0].count, (std::vector<std::int64_t>{4, 6}));
  EXPECT_EQ(p.pieces[0].global_shape, (std::vector<std::int64_t>{40, 12}));
  EXPECT_NO_THROW(validate_claims(all_claims(spec, 4, 4)));
  const auto gtp = simulate_save(spec, 4, 4);
  const auto plain = simulate_save(spec, 1, 0);
  EXPECT_EQ(gtp, plain);
}

TEST(Plan, PaddingOnlyRankSavesNothing) {
  ParamSpec spec{"w", plain_sections(61'760), {2}, TpAxis::rows, 1, {}};
  const RankPlan p = plan_rank(spec, 64, 32, {0, 63});
  EXPECT_TRUE(p.padding_only);
  EXPECT_TRUE(p.pieces.empty());
  const RankPlan q = plan_rank(spec, 64, 32, {0, 62});
  ASSERT_EQ(q.pieces.size(), 1u);
  EXPECT_EQ(q.pieces[0].rows, 256);
  EXPECT_EQ(q.pieces[0].global_offset[0], 61'504);
}

TEST(Plan, ReplicatedWeightIsSavedByTpRankZeroOnly) {
  ParamSpec spec{"norm.weight", plain_sections(10), {}, TpAxis::replicated, 2, {}};
  EXPECT_TRUE(plan_rank(spec, 2, 4, {0, 1}).main_replica);
  EXPECT_FALSE(plan_rank(spec, 2, 4, {1, 1}).main_replica);
  EXPECT_EQ(blocks(spec)[0].global_shape, (std::vector<std::int64_t>{10}));
  EXPECT_NO_THROW(validate_claims(all_claims(spec, 2, 4)));
}

TEST(Plan, ParamAtAnotherTpKeepsGlobalBlocks) {
  const SsmDims d{.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};
  ParamSpec tp2{"in_proj.weight", gdp_in_proj_sections(d, 2), {4}, TpAxis::rows, 2, ssm_divisors(d)};
  const ParamRecord global = record_of(tp2);
  ParamSpec tp1 = spec_at_tp(global, 1);
  EXPECT_EQ(tp1.sections, gdp_in_proj_sections(d, 1));
  for (std::size_t j = 0; j < global.blocks.size(); ++j)
    EXPECT_EQ(blocks(tp1)[j].global_shape, blocks(tp2)[j].global_shape);
  EXPECT_THROW((void)spec_at_tp(global, 3), Error);
  EXPECT_EQ(global.divisors, ssm_divisors(d));
  EXPECT_EQ(tp1.divisors, ssm_divisors(d));
}

// The Errc::layout message `fn` throws ("" when it throws none, or another error).
template <class Fn>
std::string layout_refusal(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code() == Errc::layout ? e.what() : cat("not a layout error: ", e.what());
  }
  return "";
}

// Rows that divide by TP 3 and 8 (dI 24, gS 24, nH 8) in a model of 8 heads and 4 groups: only the
// divisors know that TP 3 splits no head and TP 8 no group.
constexpr SsmDims odd_tp_dims{.heads = 8, .head_dim = 3, .groups = 4, .state = 6, .householder = 1};

TEST(TpDivisors, ATpThatDoesNotDivideHeadsOrGroupsIsRefusedWithOneMessage) {
  const SsmDims& d = odd_tp_dims;
  const ParamSpec tp1{"in_proj.weight", gdp_in_proj_sections(d, 1), {4}, TpAxis::rows, 1, ssm_divisors(d)};
  const ParamRecord record = record_of(tp1);
  for (const auto& [tp, text] : {std::pair<std::int64_t, std::string>{3, "heads (8) does not divide by TP 3"},
                                 {8, "groups (4) does not divide by TP 8"}}) {
    const std::string with_key = "in_proj.weight: " + text;
    EXPECT_EQ(layout_refusal([&] { (void)spec_at_tp(record, tp); }), with_key);
    ParamSpec at_tp = tp1;
    at_tp.tp = tp;
    EXPECT_EQ(layout_refusal([&] { validate(at_tp); }), with_key);
    EXPECT_EQ(layout_refusal([&] { require_tp_divides("in_proj.weight", at_tp.divisors, tp); }), with_key);
    EXPECT_EQ(layout_refusal([&] { (void)gdp_in_proj_sections(d, tp); }), text);
    EXPECT_EQ(layout_refusal([&] { (void)mamba_conv1d_sections(d, tp); }), text);
  }
  // A record written before divisors existed plans at TP 8, whose rows all divide (nH = 8 rows of b0
  // and a, which TP 3 does not divide, refuse TP 3 for the heads in another message).
  ParamRecord old = record;
  old.divisors.clear();
  EXPECT_EQ(spec_at_tp(old, 8).rows(), tp1.rows() / 8);
  EXPECT_EQ(layout_refusal([&] { (void)spec_at_tp(old, 3); }),
            "in_proj.weight block 'b0' rows (8) does not divide by TP 3");
  EXPECT_EQ(spec_at_tp(record, 4).divisors, ssm_divisors(d));
}

TEST(TpDivisors, ValidateRefusesUnnamedRepeatedAndNonPositiveDivisors) {
  ParamSpec spec{"w", plain_sections(8), {2}, TpAxis::rows, 1, {}};
  for (const auto& [divisors, why] : std::vector<std::pair<std::vector<TpDivisor>, std::string>>{
           {{{"", 4}}, "w: a TP divisor needs a name"},
           {{{"heads", 4}, {"heads", 8}}, "w: TP divisor 'heads' appears twice"},
           {{{"heads", 0}}, "w: TP divisor heads must be positive (got 0)"},
           {{{"heads", -8}}, "w: TP divisor heads must be positive (got -8)"}}) {
    spec.divisors = divisors;
    EXPECT_EQ(layout_refusal([&] { validate(spec); }), why);
    EXPECT_EQ(layout_refusal([&] { (void)spec_at_tp(record_of(spec), 3); }), why);
  }
}

TEST(Validation, OverlapNamesKeyRanksAndRows) {
  std::vector<Claim> c{claim("k", DType::f32, {10, 2}, {0, 0}, {6, 2}, 0, true),
                       claim("k", DType::f32, {10, 2}, {4, 0}, {6, 2}, 1, true)};
  try {
    validate_claims(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::tiling);
    EXPECT_NE(std::string(e.what()).find("key k: rows [4, 6) are saved by both rank 0 and rank 1"), std::string::npos)
        << e.what();
  }
}

TEST(Validation, GapNamesKeyAndRows) {
  std::vector<Claim> c{claim("k", DType::f32, {10, 2}, {0, 0}, {4, 2}, 0, true),
                       claim("k", DType::f32, {10, 2}, {6, 0}, {4, 2}, 1, true),
                       claim("k", DType::f32, {10, 2}, {4, 0}, {2, 2}, 2, false)};  // a replica does not count
  try {
    validate_claims(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::tiling);
    EXPECT_NE(std::string(e.what()).find("key k: rows [4, 6) are saved by no rank"), std::string::npos) << e.what();
  }
}

TEST(Validation, ColumnGapIsFoundInItsBand) {
  std::vector<Claim> c{claim("k", DType::f32, {4, 6}, {0, 0}, {4, 3}, 0, true),
                       claim("k", DType::f32, {4, 6}, {0, 3}, {2, 3}, 1, true)};
  try {
    validate_claims(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rows [2, 4) (elements [3, 6) of each row) are saved by no rank"),
              std::string::npos)
        << e.what();
  }
}

TEST(Validation, DtypeAndShapeDisagreementAreTyped) {
  std::vector<Claim> dt{claim("k", DType::f32, {4}, {0}, {2}, 0, true), claim("k", DType::bf16, {4}, {2}, {2}, 3, true)};
  try {
    validate_claims(dt);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::dtype_mismatch);
    EXPECT_NE(std::string(e.what()).find("rank 3 saves bf16"), std::string::npos) << e.what();
  }
  std::vector<Claim> sh{claim("k", DType::f32, {4}, {0}, {2}, 0, true), claim("k", DType::f32, {6}, {2}, {2}, 1, true)};
  try {
    validate_claims(sh);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::shape_mismatch);
  }
}

// Many random layouts: every block tiled exactly once, no pad row in any piece, and
// floor(P / L) padding-only ranks.
TEST(Property, RandomLayoutsTileEveryBlockExactlyOnce) {
  std::mt19937_64 rng(20261130);
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 400; ++iter) {
    ParamSpec spec;
    spec.key = "p" + std::to_string(iter);
    spec.tp = static_cast<int>(pick(1, 4));
    const int kind = static_cast<int>(pick(0, 2));
    spec.tp_axis = kind == 0 ? TpAxis::rows : kind == 1 ? TpAxis::cols : TpAxis::replicated;
    const std::int64_t nsec = spec.tp_axis == TpAxis::cols ? 1 : pick(1, 7);
    for (std::int64_t s = 0; s < nsec; ++s)
      spec.sections.push_back({nsec == 1 ? "" : "s" + std::to_string(s), pick(1, 40)});
    spec.trailing = {pick(1, 3)};
    if (pick(0, 1)) spec.trailing.push_back(pick(1, 2));
    const std::int64_t gtp = pick(1, 9);
    std::int64_t align = pick(0, 8);
    if (align == 0 && spec.rows() % gtp != 0) align = 1;
    SCOPED_TRACE(::testing::Message() << "R=" << spec.rows() << " tp=" << spec.tp << " gtp=" << gtp
                                      << " align=" << align);
    const GtpGeometry g = GtpGeometry::make(spec.rows(), gtp, align);
    EXPECT_EQ(g.shard_rows() * gtp, spec.rows() + g.pad());
    if (align > 0) EXPECT_EQ(g.shard_rows() % align, 0);
    int padding_only = 0;
    for (int r = 0; r < gtp; ++r) {
      const RankPlan p = plan_rank(spec, gtp, align, {0, r});
      padding_only += p.padding_only;
      for (const Piece& piece : p.pieces) EXPECT_LE(piece.shard_row + piece.rows, p.real_rows);
      if (p.padding_only) EXPECT_TRUE(p.pieces.empty());
    }
    EXPECT_EQ(padding_only, g.padding_only_ranks());
    EXPECT_NO_THROW(validate_claims(all_claims(spec, gtp, align)));
    if (iter % 8 == 0) EXPECT_EQ(simulate_save(spec, gtp, align), simulate_save(spec, 1, 0));
  }
}

// A distributed optimizer's flat range that starts and ends mid-row covers a piece as a partial
// head row, whole rows and a partial tail row, in that order, each at its place in the range.
TEST(FlatParts, ARangeThatStartsAndEndsMidRowGivesHeadWholeRowsAndTail) {
  // Shard rows [2, 8) of a shard with 4 elements a row, saved at rows [12, 18) of a (20, 4) dataset.
  const Piece piece{"k", 0, {20, 4}, {12, 0}, {6, 4}, 6, 2};
  // Elements [9, 27): row 2 from element 1, rows 3..5 whole, row 6 up to element 3.
  const auto parts = flat_parts(piece, 4, {9, 27});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].box, (Box{{12, 13}, {1, 4}}));
  EXPECT_EQ(parts[0].range_offset, 0);
  EXPECT_EQ(parts[1].box, (Box{{13, 16}, {0, 4}}));
  EXPECT_EQ(parts[1].range_offset, 3);
  EXPECT_EQ(parts[2].box, (Box{{16, 17}, {0, 3}}));
  EXPECT_EQ(parts[2].range_offset, 15);
  // The parts follow each other in the range without gap or overlap.
  std::int64_t next = 0;
  for (const FlatPart& p : parts) {
    EXPECT_EQ(p.range_offset, next);
    next += box_elements(p.box);
  }
  EXPECT_EQ(next, 27 - 9);

  // A range that starts before the piece is clipped to it; its offsets still count from the range's start.
  const auto clipped = flat_parts(piece, 4, {3, 14});
  ASSERT_EQ(clipped.size(), 2u);
  EXPECT_EQ(clipped[0].box, (Box{{12, 13}, {0, 4}}));
  EXPECT_EQ(clipped[0].range_offset, 5);
  EXPECT_EQ(clipped[1].box, (Box{{13, 14}, {0, 2}}));
  EXPECT_EQ(clipped[1].range_offset, 9);

  // Inside one row: one part. Outside the piece: none.
  const auto inside = flat_parts(piece, 4, {21, 23});
  ASSERT_EQ(inside.size(), 1u);
  EXPECT_EQ(inside[0].box, (Box{{15, 16}, {1, 3}}));
  EXPECT_EQ(inside[0].range_offset, 0);
  EXPECT_TRUE(flat_parts(piece, 4, {0, 8}).empty());
  EXPECT_TRUE(flat_parts(piece, 4, {32, 40}).empty());

  // A row-parallel piece: its columns start at its TP rank's band.
  const Piece cols{"o", 0, {40, 12}, {36, 6}, {4, 6}, 4, 0};
  const auto band = flat_parts(cols, 6, {4, 20});
  ASSERT_EQ(band.size(), 3u);
  EXPECT_EQ(band[0].box, (Box{{36, 37}, {10, 12}}));
  EXPECT_EQ(band[1].box, (Box{{37, 39}, {6, 12}}));
  EXPECT_EQ(band[1].range_offset, 2);
  EXPECT_EQ(band[2].box, (Box{{39, 40}, {6, 8}}));
  EXPECT_EQ(band[2].range_offset, 14);
}

// Balanced shares tile [0, n) in order, and their sizes differ by at most one.
TEST(BalancedShare, SharesTileTheRangeInOrderAndDifferByAtMostOne) {
  for (std::int64_t n = 0; n <= 70; ++n)
    for (std::int64_t count = 1; count <= 9; ++count) {
      std::int64_t cursor = 0, smallest = n, largest = 0;
      for (std::int64_t i = 0; i < count; ++i) {
        const Range s = balanced_share(n, count, i);
        ASSERT_EQ(s.begin, cursor) << "n " << n << " count " << count << " share " << i;
        ASSERT_LE(s.begin, s.end);
        cursor = s.end;
        smallest = std::min(smallest, s.size());
        largest = std::max(largest, s.size());
      }
      ASSERT_EQ(cursor, n) << "n " << n << " count " << count;
      ASSERT_LE(largest - smallest, 1) << "n " << n << " count " << count;
    }
  // Large values do not overflow.
  const std::int64_t big = std::int64_t{1} << 62;
  EXPECT_EQ(balanced_share(big, 3, 2).end, big);
  EXPECT_THROW((void)balanced_share(10, 0, 0), Error);
  EXPECT_THROW((void)balanced_share(10, 2, 2), Error);
  EXPECT_THROW((void)balanced_share(-1, 2, 0), Error);
}

// A slab that splits a dim past dim 1 is cut into runs contiguous in both the slab and the dataset:
// a layer-stacked (L, h, f) weight split on its last dim is one run per (layer, row of dim 1).
TEST(SlabParts, ALayerStackedRowParallelWeightIsOneRunPerRowOfDim1) {
  const std::vector<std::int64_t> shape{3, 4, 6};
  EXPECT_FALSE(splits_past_dim1(shape, std::vector<std::int64_t>{1, 2, 0}, std::vector<std::int64_t>{1, 2, 6}));
  ASSERT_TRUE(splits_past_dim1(shape, std::vector<std::int64_t>{1, 0, 3}, std::vector<std::int64_t>{1, 4, 3}));
  const std::vector<SlabPart> parts =
      slab_parts("w", shape, std::vector<std::int64_t>{1, 0, 3}, std::vector<std::int64_t>{1, 4, 3});
  ASSERT_EQ(parts.size(), 4u);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto a = static_cast<std::int64_t>(i);
    EXPECT_EQ(parts[i].box, (Box{{1, 2}, {a * 6 + 3, a * 6 + 6}})) << i;
    EXPECT_EQ(parts[i].slab_row, 0);
    EXPECT_EQ(parts[i].slab_offset, a * 3);
  }
  // Dims past the last split one are whole and go with it; dim 0 rows are parts of their own.
  const std::vector<SlabPart> four = slab_parts("g", std::vector<std::int64_t>{2, 3, 4, 5},
                                                std::vector<std::int64_t>{0, 1, 2, 0}, std::vector<std::int64_t>{2, 2, 1, 5});
  ASSERT_EQ(four.size(), 4u);  // 2 rows x 2 indices of dim 1, dims 2..3 one run of 5
  EXPECT_EQ(four[0].box, (Box{{0, 1}, {(1 * 4 + 2) * 5, (1 * 4 + 3) * 5}}));
  EXPECT_EQ(four[1].box, (Box{{0, 1}, {(2 * 4 + 2) * 5, (2 * 4 + 3) * 5}}));
  EXPECT_EQ(four[2].box, (Box{{1, 2}, {(1 * 4 + 2) * 5, (1 * 4 + 3) * 5}}));
  EXPECT_EQ(four[3].slab_row, 1);
  EXPECT_EQ(four[3].slab_offset, 15);
  // Every element of a slab is in exactly one part, at its place in the dataset.
  const std::vector<std::int64_t> big{2, 3, 4, 5}, off{1, 0, 1, 2}, cnt{1, 3, 2, 3};
  std::vector<int> seen(2 * 3 * 4 * 5, 0);
  std::int64_t elems = 0;
  for (const SlabPart& p : slab_parts("g", big, off, cnt)) {
    EXPECT_EQ(p.slab_offset, elems);
    for (std::int64_t c = p.box.cols.begin; c < p.box.cols.end; ++c) ++seen[static_cast<std::size_t>(p.box.rows.begin * 60 + c)];
    elems += p.box.cols.size();
  }
  EXPECT_EQ(elems, 1 * 3 * 2 * 3);
  for (std::int64_t d1 = 0; d1 < 3; ++d1)
    for (std::int64_t d2 = 0; d2 < 4; ++d2)
      for (std::int64_t d3 = 0; d3 < 5; ++d3) {
        const bool inside = d2 >= 1 && d2 < 3 && d3 >= 2 && d3 < 5;
        EXPECT_EQ(seen[static_cast<std::size_t>(60 + (d1 * 4 + d2) * 5 + d3)], inside ? 1 : 0) << d1 << d2 << d3;
      }
  EXPECT_THROW((void)slab_parts("w", std::vector<std::int64_t>{3, 4, 6}, std::vector<std::int64_t>{0, 0, 4},
                                std::vector<std::int64_t>{1, 4, 3}),
               Error);  // leaves dim 2
}
