module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <range/v3/numeric/accumulate.hpp>
#include <range/v3/view/exclusive_scan.hpp>
#include <range/v3/view/transform.hpp>
#include <range/v3/view/zip.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module shardckpt.layout;

namespace shardckpt {
namespace {

std::int64_t per_tp(std::int64_t total, int tp, std::string_view what) {
  require(total > 0, Errc::layout, what, " must be positive (got ", total, ")");
  require(tp >= 1, Errc::layout, "TP must be at least 1 (got ", tp, ")");
  require(total % tp == 0, Errc::layout, what, " (", total, ") does not divide by TP ", tp);
  return total / tp;
}

// Sizes shared by the GDP and Mamba layouts: dI, gS and nH of SPEC.md.
struct LocalDims {
  std::int64_t d_inner, group_state, heads, householder;
};

LocalDims local_dims(const SsmDims& d, int tp) {
  require(d.head_dim > 0 && d.state > 0, Errc::layout, "head_dim (", d.head_dim, ") and state (", d.state,
          ") must be positive");
  require(d.householder >= 1, Errc::layout, "householder count must be at least 1 (got ", d.householder, ")");
  const std::int64_t heads = per_tp(d.heads, tp, "heads");
  return {heads * d.head_dim, per_tp(d.groups, tp, "groups") * d.state, heads, d.householder};
}

void add_repeated(std::vector<Section>& out, std::string_view prefix, std::int64_t n, std::int64_t rows) {
  for (std::int64_t i = 0; i < n; ++i) out.push_back({cat(prefix, i), rows});
}

}  // namespace

GtpGeometry GtpGeometry::make(std::int64_t rows, std::int64_t group, std::int64_t align) {
  require(rows >= 1, Errc::layout, "a parameter needs at least one row (got ", rows, ")");
  require(group >= 1, Errc::layout, "GTP group size must be at least 1 (got ", group, ")");
  require(align >= 0, Errc::layout, "alignment must be >= 0 (got ", align, ")");
  require(align > 0 || rows % group == 0, Errc::layout, "alignment 0 needs rows (", rows,
          ") to divide by the GTP group size ", group);
  GtpGeometry g;
  g.rows_ = rows;
  g.group_ = group;
  g.align_ = align;
  if (align > 0) {
    const std::int64_t block = align * group;
    g.pad_ = (block - rows % block) % block;
  }
  g.shard_rows_ = (rows + g.pad_) / group;
  return g;
}

std::vector<Section> gdp_in_proj_sections(const SsmDims& dims, int tp) {
  const LocalDims d = local_dims(dims, tp);
  std::vector<Section> out{{"z", d.d_inner}};
  add_repeated(out, "V", d.householder, d.d_inner);
  add_repeated(out, "K", d.householder, d.group_state);
  out.push_back({"Q", d.group_state});
  add_repeated(out, "b", d.householder, d.heads);
  out.push_back({"a", d.heads});
  return out;
}

std::vector<Section> gdp_conv1d_sections(const SsmDims& dims, int tp) {
  const LocalDims d = local_dims(dims, tp);
  std::vector<Section> out;
  add_repeated(out, "V", d.householder, d.d_inner);
  add_repeated(out, "K", d.householder, d.group_state);
  out.push_back({"Q", d.group_state});
  return out;
}

std::vector<Section> mamba_in_proj_sections(const SsmDims& dims, int tp) {
  const LocalDims d = local_dims(dims, tp);
  return {{"z", d.d_inner}, {"x", d.d_inner}, {"B", d.group_state}, {"C", d.group_state}, {"dt", d.heads}};
}

std::vector<Section> mamba_conv1d_sections(const SsmDims& dims, int tp) {
  const LocalDims d = local_dims(dims, tp);
  return {{"x", d.d_inner}, {"B", d.group_state}, {"C", d.group_state}};
}

std::vector<Section> plain_sections(std::int64_t rows) { return {{"", rows}}; }

std::string_view tp_axis_name(TpAxis axis) noexcept {
  switch (axis) {
    case TpAxis::rows:
      return "rows";
    case TpAxis::cols:
      return "cols";
    case TpAxis::replicated:
      return "replicated";
  }
  return "?";
}

TpAxis parse_tp_axis(std::string_view name) {
  for (TpAxis a : {TpAxis::rows, TpAxis::cols, TpAxis::replicated})
    if (tp_axis_name(a) == name) return a;
  throw Error(Errc::invalid_argument, cat("unknown TP axis '", name, "' (expected rows, cols or replicated)"));
}

std::int64_t ParamSpec::rows() const noexcept {
  return ranges::accumulate(sections, std::int64_t{0}, std::plus<>{}, &Section::rows);
}

std::int64_t ParamSpec::row_elems() const noexcept { return element_count(trailing); }

void validate(const ParamSpec& spec) {
  require(!spec.key.empty() && spec.key.find('/') == std::string::npos && spec.key[0] != '_', Errc::invalid_argument,
          "parameter key '", spec.key, "' must be non-empty, contain no '/' and not start with '_'");
  require(spec.tp >= 1, Errc::layout, spec.key, ": TP must be at least 1 (got ", spec.tp, ")");
  require(!spec.sections.empty(), Errc::layout, spec.key, ": a parameter needs at least one section");
  std::set<std::string_view> names;
  for (const Section& s : spec.sections) {
    require(s.rows > 0, Errc::layout, spec.key, ": section '", s.name, "' has ", s.rows,
            " rows; sections must be positive");
    require(names.insert(s.name).second, Errc::layout, spec.key, ": section name '", s.name, "' appears twice");
    require(s.name.find('/') == std::string::npos, Errc::invalid_argument, spec.key, ": section name '", s.name,
            "' contains '/'");
  }
  require(spec.sections.size() == 1 || !spec.sections[0].name.empty(), Errc::layout, spec.key,
          ": only a single-section (plain) weight may have an unnamed section");
  for (std::int64_t d : spec.trailing)
    require(d > 0, Errc::layout, spec.key, ": trailing dims must be positive (got ", d, ")");
  if (spec.tp_axis == TpAxis::cols) {
    require(spec.sections.size() == 1, Errc::layout, spec.key,
            ": a weight split along dim 1 must be unfused (one section), got ", spec.sections.size());
    require(!spec.trailing.empty(), Errc::layout, spec.key, ": a weight split along dim 1 needs dim 1");
  }
}

std::string block_key(std::string_view param_key, std::string_view name) {
  return name.empty() ? std::string(param_key) : cat(param_key, '.', name);
}

std::vector<Block> blocks(const ParamSpec& spec) {
  std::vector<Block> out;
  out.reserve(spec.sections.size());
  // S_j: the first TP-local row of section j is the exclusive prefix sum of the sizes before it.
  auto starts =
      spec.sections | ranges::views::transform(&Section::rows) | ranges::views::exclusive_scan(std::int64_t{0});
  for (auto [section, start] : ranges::views::zip(spec.sections, starts)) {
    Block b{block_key(spec.key, section.name), {start, start + section.rows}, {}};
    b.global_shape.push_back(spec.tp_axis == TpAxis::rows ? section.rows * spec.tp : section.rows);
    b.global_shape.insert(b.global_shape.end(), spec.trailing.begin(), spec.trailing.end());
    if (spec.tp_axis == TpAxis::cols) b.global_shape[1] *= spec.tp;
    out.push_back(std::move(b));
  }
  return out;
}

ParamSpec param_at_tp(std::string key, std::span<const Section> global, std::span<const std::int64_t> trailing,
                      TpAxis axis, int tp) {
  ParamSpec spec{std::move(key), {}, {trailing.begin(), trailing.end()}, axis, tp};
  require(tp >= 1, Errc::layout, spec.key, ": TP must be at least 1 (got ", tp, ")");
  for (const Section& s : global)
    spec.sections.push_back(
        {s.name, axis == TpAxis::rows ? per_tp(s.rows, tp, cat(spec.key, " block '", s.name, "' rows")) : s.rows});
  if (axis == TpAxis::cols) {
    require(!spec.trailing.empty(), Errc::layout, spec.key, ": a weight split along dim 1 needs dim 1");
    spec.trailing[0] = per_tp(spec.trailing[0], tp, cat(spec.key, " dim 1"));
  }
  validate(spec);
  return spec;
}

std::vector<Section> global_sections(const ParamSpec& spec) {
  std::vector<Section> out = spec.sections;
  if (spec.tp_axis == TpAxis::rows)
    for (Section& s : out) s.rows *= spec.tp;
  return out;
}

std::vector<std::int64_t> global_trailing(const ParamSpec& spec) {
  std::vector<std::int64_t> out = spec.trailing;
  if (spec.tp_axis == TpAxis::cols) out[0] *= spec.tp;
  return out;
}

RankPlan plan_rank(const ParamSpec& spec, std::int64_t gtp, std::int64_t align, ShardCoord coord) {
  require(coord.tp_rank >= 0 && coord.tp_rank < spec.tp, Errc::invalid_argument, spec.key, ": TP rank ", coord.tp_rank,
          " is outside [0, ", spec.tp, ")");
  require(coord.gtp_rank >= 0 && coord.gtp_rank < gtp, Errc::invalid_argument, spec.key, ": GTP rank ", coord.gtp_rank,
          " is outside [0, ", gtp, ")");
  RankPlan plan;
  plan.coord = coord;
  plan.geometry = GtpGeometry::make(spec.rows(), gtp, align);
  plan.row_elems = spec.row_elems();
  plan.real_rows = plan.geometry.real_count(coord.gtp_rank);
  plan.padding_only = plan.real_rows == 0;
  plan.main_replica = spec.tp_axis != TpAxis::replicated || coord.tp_rank == 0;
  const RowRange real = plan.geometry.real_rows(coord.gtp_rank);
  const std::vector<Block> all = blocks(spec);
  for (std::size_t j = 0; j < all.size(); ++j) {
    const Block& b = all[j];
    const RowRange hit = real.intersect(b.local_rows);  // [lo, hi) of SPEC.md, "What a rank saves"
    if (hit.empty()) continue;
    Piece p{b.key, j,          b.global_shape,        std::vector<std::int64_t>(b.global_shape.size(), 0),
            {},    hit.size(), hit.begin - real.begin};
    p.count.push_back(hit.size());
    p.count.insert(p.count.end(), spec.trailing.begin(), spec.trailing.end());
    switch (spec.tp_axis) {
      case TpAxis::rows:
        p.global_offset[0] = coord.tp_rank * b.local_rows.size() + hit.begin - b.local_rows.begin;
        break;
      case TpAxis::cols:
        p.global_offset[0] = hit.begin;
        p.global_offset[1] = coord.tp_rank * spec.trailing[0];
        break;
      case TpAxis::replicated:
        p.global_offset[0] = hit.begin - b.local_rows.begin;
        break;
    }
    plan.pieces.push_back(std::move(p));
  }
  return plan;
}

Box footprint(const Claim& c) {
  const std::size_t rank = c.global_shape.size();
  require(rank >= 1 && c.global_offset.size() == rank && c.count.size() == rank, Errc::invalid_argument, c.key,
          ": rank ", c.rank, " claims a slab whose offset/count do not match the dataset's rank ", rank);
  for (std::size_t d = 0; d < rank; ++d) {
    require(c.global_offset[d] >= 0 && c.count[d] >= 0 && c.global_offset[d] + c.count[d] <= c.global_shape[d],
            Errc::invalid_argument, c.key, ": rank ", c.rank, " claims [", c.global_offset[d], ", ",
            c.global_offset[d] + c.count[d], ") of dim ", d, " whose size is ", c.global_shape[d]);
    require(d < 2 || (c.global_offset[d] == 0 && c.count[d] == c.global_shape[d]), Errc::invalid_argument, c.key,
            ": rank ", c.rank, " splits dim ", d, "; only dims 0 and 1 may be split");
  }
  Box box{{c.global_offset[0], c.global_offset[0] + c.count[0]}, {0, 1}};
  if (rank >= 2) {
    const std::int64_t inner = element_count(std::span(c.global_shape).subspan(2));
    box.cols = {c.global_offset[1] * inner, (c.global_offset[1] + c.count[1]) * inner};
  }
  return box;
}

void validate_claims(std::span<const Claim> claims) {
  std::map<std::string_view, std::vector<const Claim*>> by_key;
  for (const Claim& c : claims) by_key[c.key].push_back(&c);

  std::vector<std::string> problems;
  auto report = [&](std::string text) {
    if (problems.size() < 16) problems.push_back(std::move(text));
  };
  for (const auto& [key, list] : by_key) {
    const Claim& first = *list.front();
    for (const Claim* c : list) {
      require(c->dtype == first.dtype, Errc::dtype_mismatch, "key ", key, ": rank ", first.rank, " saves ",
              dtype_name(first.dtype), " but rank ", c->rank, " saves ", dtype_name(c->dtype));
      require(c->global_shape == first.global_shape, Errc::shape_mismatch, "key ", key, ": ranks ", first.rank, " and ",
              c->rank, " disagree on the global shape");
    }
    struct Owned {
      Box box;
      int rank;
    };
    std::vector<Owned> boxes;
    std::set<std::int64_t> cuts;
    for (const Claim* c : list) {
      Box b = footprint(*c);
      if (!c->main_replica || b.rows.empty() || b.cols.empty()) continue;
      boxes.push_back({b, c->rank});
      cuts.insert(b.cols.begin);
      cuts.insert(b.cols.end);
    }
    const Claim probe{std::string(key),
                      first.dtype,
                      first.global_shape,
                      std::vector<std::int64_t>(first.global_shape.size(), 0),
                      first.global_shape,
                      0,
                      true};
    const Box whole = footprint(probe);
    cuts.insert(whole.cols.begin);
    cuts.insert(whole.cols.end);
    // Between two consecutive column cuts every box either covers the whole band or none of it, so
    // each band reduces to a 1-D check of row intervals.
    for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it) {
      const RowRange band{*it, *std::next(it)};
      std::vector<const Owned*> in_band;
      for (const Owned& o : boxes)
        if (o.box.cols.begin <= band.begin && band.end <= o.box.cols.end) in_band.push_back(&o);
      std::sort(in_band.begin(), in_band.end(),
                [](const Owned* a, const Owned* b) { return a->box.rows.begin < b->box.rows.begin; });
      std::int64_t cursor = 0;
      const Owned* prev = nullptr;
      const std::string where =
          whole.cols == band ? std::string() : cat(" (elements [", band.begin, ", ", band.end, ") of each row)");
      for (const Owned* o : in_band) {
        if (o->box.rows.begin > cursor)
          report(cat("key ", key, ": rows [", cursor, ", ", o->box.rows.begin, ")", where, " are saved by no rank"));
        else if (o->box.rows.begin < cursor)
          report(cat("key ", key, ": rows [", o->box.rows.begin, ", ", std::min(cursor, o->box.rows.end), ")", where,
                     " are saved by both rank ", prev->rank, " and rank ", o->rank));
        if (o->box.rows.end > cursor) {
          cursor = o->box.rows.end;
          prev = o;
        }
      }
      if (cursor < whole.rows.end)
        report(cat("key ", key, ": rows [", cursor, ", ", whole.rows.end, ")", where, " are saved by no rank"));
    }
  }
  if (!problems.empty()) {
    std::string text = "pieces do not tile the checkpoint exactly once";
    for (const std::string& p : problems) text += "\n  " + p;
    throw Error(Errc::tiling, std::move(text));
  }
}

}  // namespace shardckpt
