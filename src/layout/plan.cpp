// shardckpt.layout: sections, specs, records and the plan of a rank's pieces (plan_rank).
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
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

std::int64_t per_tp(std::int64_t total, std::int64_t tp, std::string_view what) {
  require(total > 0, Errc::layout, what, " must be positive (got ", total, ")");
  require(tp >= 1, Errc::layout, "TP must be at least 1 (got ", tp, ")");
  require(total % tp == 0, Errc::layout, what, " (", total, ") does not divide by TP ", tp);
  return total / tp;
}

// Sizes shared by the GDP and Mamba layouts: dI = heads*head_dim/TP, gS = (groups/TP)*state and
// nH = heads/TP.
struct LocalDims {
  std::int64_t d_inner, group_state, heads, householder;
};

LocalDims local_dims(const SsmDims& d, std::int64_t tp) {
  require(d.heads > 0 && d.groups > 0, Errc::layout, "heads (", d.heads, ") and groups (", d.groups,
          ") must be positive");
  require(d.head_dim > 0 && d.state > 0, Errc::layout, "head_dim (", d.head_dim, ") and state (", d.state,
          ") must be positive");
  require(d.householder >= 1 && d.householder <= max_householder, Errc::layout, "householder count must be in [1, ",
          max_householder, "] (got ", d.householder, ")");
  require_tp_divides("", ssm_divisors(d), tp);
  const std::int64_t heads = d.heads / tp;
  return {checked_mul(heads, d.head_dim, "heads x head_dim", Errc::layout),
          checked_mul(d.groups / tp, d.state, "groups x state", Errc::layout), heads, d.householder};
}

// A spec's divisors are named, once each, and positive: what require_tp_divides can check.
void validate_divisors(const ParamSpec& spec) {
  std::set<std::string_view> names;
  for (const TpDivisor& d : spec.divisors) {
    require(!d.name.empty(), Errc::layout, spec.key, ": a TP divisor needs a name");
    require(names.insert(d.name).second, Errc::layout, spec.key, ": TP divisor '", d.name, "' appears twice");
    require(d.count > 0, Errc::layout, spec.key, ": TP divisor ", d.name, " must be positive (got ", d.count, ")");
  }
}

void add_repeated(std::vector<Section>& out, std::string_view prefix, std::int64_t n, std::int64_t rows) {
  for (std::int64_t i = 0; i < n; ++i) out.push_back({cat(prefix, i), rows});
}

}  // namespace

void require_tp_divides(std::string_view key, std::span<const TpDivisor> divisors, std::int64_t tp) {
  const std::string_view sep = key.empty() ? "" : ": ";
  require(tp >= 1, Errc::layout, key, sep, "TP must be at least 1 (got ", tp, ")");
  for (const TpDivisor& d : divisors)
    require(d.count % tp == 0, Errc::layout, key, sep, d.name, " (", d.count, ") does not divide by TP ", tp);
}

std::vector<TpDivisor> ssm_divisors(const SsmDims& dims) { return {{"heads", dims.heads}, {"groups", dims.groups}}; }

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
    const std::int64_t block = checked_mul(align, group, "alignment x GTP group size", Errc::layout);
    g.pad_ = (block - rows % block) % block;
  }
  g.shard_rows_ = checked_add(rows, g.pad_, "padded rows", Errc::layout) / group;
  return g;
}

std::vector<Section> gdp_in_proj_sections(const SsmDims& dims, std::int64_t tp) {
  const LocalDims d = local_dims(dims, tp);
  std::vector<Section> out{{"z", d.d_inner}};
  add_repeated(out, "V", d.householder, d.d_inner);
  add_repeated(out, "K", d.householder, d.group_state);
  out.push_back({"Q", d.group_state});
  add_repeated(out, "b", d.householder, d.heads);
  out.push_back({"a", d.heads});
  return out;
}

std::vector<Section> gdp_conv1d_sections(const SsmDims& dims, std::int64_t tp) {
  const LocalDims d = local_dims(dims, tp);
  std::vector<Section> out;
  add_repeated(out, "V", d.householder, d.d_inner);
  add_repeated(out, "K", d.householder, d.group_state);
  out.push_back({"Q", d.group_state});
  return out;
}

std::vector<Section> mamba_in_proj_sections(const SsmDims& dims, std::int64_t tp) {
  const LocalDims d = local_dims(dims, tp);
  return {{"z", d.d_inner}, {"x", d.d_inner}, {"B", d.group_state}, {"C", d.group_state}, {"dt", d.heads}};
}

std::vector<Section> mamba_conv1d_sections(const SsmDims& dims, std::int64_t tp) {
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

std::int64_t ParamSpec::rows() const {
  std::int64_t n = 0;
  for (const Section& s : sections) n = checked_add(n, s.rows, cat(key, ": rows of all sections"), Errc::layout);
  return n;
}

std::int64_t ParamSpec::row_elems() const { return element_count(trailing, cat(key, ": elements of a row"), Errc::layout); }

void validate(const ParamSpec& spec) {
  require(!spec.key.empty() && spec.key.find('/') == std::string::npos && spec.key[0] != '_', Errc::invalid_argument,
          "parameter key '", spec.key, "' must be non-empty, contain no '/' and not start with '_'");
  require_name(spec.key, "a parameter key");
  require(spec.tp >= 1, Errc::layout, spec.key, ": TP must be at least 1 (got ", spec.tp, ")");
  validate_divisors(spec);
  require_tp_divides(spec.key, spec.divisors, spec.tp);
  require(!spec.sections.empty(), Errc::layout, spec.key, ": a parameter needs at least one section");
  std::set<std::string_view> names;
  for (const Section& s : spec.sections) {
    require(s.rows > 0, Errc::layout, spec.key, ": section '", s.name, "' has ", s.rows,
            " rows; sections must be positive");
    if (!s.name.empty()) require_name(s.name, cat(spec.key, ": a section name"));
    require(names.insert(s.name).second, Errc::layout, spec.key, ": section name '", s.name, "' appears twice");
    require(s.name.find('/') == std::string::npos, Errc::invalid_argument, spec.key, ": section name '", s.name,
            "' contains '/'");
  }
  require(spec.sections.size() == 1 || !spec.sections[0].name.empty(), Errc::layout, spec.key,
          ": only a single-section (plain) weight may have an unnamed section");
  for (std::int64_t d : spec.trailing)
    require(d > 0, Errc::layout, spec.key, ": trailing dims must be positive (got ", d, ")");
  // Every size below derives from these two; both must fit, and so must the global shape.
  const std::int64_t elements = checked_mul(spec.rows(), spec.row_elems(), cat(spec.key, ": elements"), Errc::layout);
  (void)checked_mul(elements, spec.tp, cat(spec.key, ": global elements"), Errc::layout);
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
    b.global_shape.push_back(spec.tp_axis == TpAxis::rows
                                 ? checked_mul(section.rows, spec.tp, cat(b.key, ": global rows"), Errc::layout)
                                 : section.rows);
    b.global_shape.insert(b.global_shape.end(), spec.trailing.begin(), spec.trailing.end());
    if (spec.tp_axis == TpAxis::cols)
      b.global_shape[1] = checked_mul(b.global_shape[1], spec.tp, cat(b.key, ": global dim 1"), Errc::layout);
    out.push_back(std::move(b));
  }
  return out;
}

ParamRecord record_of(const ParamSpec& spec) {
  ParamRecord out{spec.key, spec.tp_axis, spec.sections, spec.trailing, spec.divisors};
  if (spec.tp_axis == TpAxis::rows)
    for (Section& s : out.blocks) s.rows = checked_mul(s.rows, spec.tp, cat(spec.key, ": global rows"), Errc::layout);
  if (spec.tp_axis == TpAxis::cols)
    out.trailing[0] = checked_mul(out.trailing[0], spec.tp, cat(spec.key, ": global dim 1"), Errc::layout);
  return out;
}

ParamSpec spec_at_tp(const ParamRecord& record, std::int64_t tp) {
  require(!record.blocks.empty(), Errc::layout, record.key, ": a parameter needs at least one block");
  ParamSpec spec{record.key, {}, record.trailing, record.tp_axis, tp, record.divisors};
  // The model's sizes before the rows: a TP that divides every block's rows but not the groups is no
  // layout of the model, and one that divides neither is refused for its heads, as validate and the
  // section functions refuse it.
  validate_divisors(spec);
  require_tp_divides(spec.key, spec.divisors, tp);
  for (const Section& s : record.blocks)
    spec.sections.push_back({s.name, record.tp_axis == TpAxis::rows
                                         ? per_tp(s.rows, tp, cat(spec.key, " block '", s.name, "' rows"))
                                         : s.rows});
  if (record.tp_axis == TpAxis::cols) {
    require(!spec.trailing.empty(), Errc::layout, spec.key, ": a weight split along dim 1 needs dim 1");
    spec.trailing[0] = per_tp(spec.trailing[0], tp, cat(spec.key, " dim 1"));
  }
  validate(spec);
  return spec;
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
  const Range real = plan.geometry.real_rows(coord.gtp_rank);
  const std::vector<Block> all = blocks(spec);
  for (std::size_t j = 0; j < all.size(); ++j) {
    const Block& b = all[j];
    const Range hit = real.intersect(b.local_rows);  // the block's rows among this rank's real rows
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

}  // namespace shardckpt
