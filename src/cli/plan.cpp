// shardckpt plan: what every (TP rank, GTP rank) saves of one parameter. Pure arithmetic.
module;
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

using json = nlohmann::json;

struct PlanFlags {
  std::string model = "gdp-in-proj";
  SsmDims dims{.heads = 8, .head_dim = 16, .groups = 4, .state = 16, .householder = 2};
  std::int64_t rows = 0, cols = 0;
  std::int64_t tp = 1, gtp = 1, align = 0;
  int tp_axis = 0;
  std::string key = "in_proj.weight";
};

ParamSpec spec_of(const PlanFlags& f) {
  std::vector<Section> sections;
  const std::vector<TpDivisor> divisors = f.model == "plain" ? std::vector<TpDivisor>{} : ssm_divisors(f.dims);
  require_tp_divides(f.key, divisors, f.tp);  // before the sections, so that the refusal names the key
  if (f.model == "gdp-in-proj")
    sections = gdp_in_proj_sections(f.dims, f.tp);
  else if (f.model == "gdp-conv1d")
    sections = gdp_conv1d_sections(f.dims, f.tp);
  else if (f.model == "mamba-in-proj")
    sections = mamba_in_proj_sections(f.dims, f.tp);
  else if (f.model == "mamba-conv1d")
    sections = mamba_conv1d_sections(f.dims, f.tp);
  else {
    require(f.rows > 0, Errc::invalid_argument, "--model plain needs --rows (TP-local rows)");
    sections = plain_sections(f.rows);
  }
  require(f.tp_axis == 0 || f.model == "plain", Errc::invalid_argument, "--tp-axis 1 is only for --model plain");
  require(f.tp * f.gtp <= max_plan_ranks, Errc::invalid_argument, "TP x GTP = ", f.tp * f.gtp,
          " ranks is more than plan prints (", max_plan_ranks, ")");
  const ParamSpec spec{f.key, sections, {f.cols}, f.tp_axis == 1 ? TpAxis::cols : TpAxis::rows, f.tp, divisors};
  validate(spec);
  return spec;
}

json plan_json(const ParamSpec& spec, const GtpGeometry& geo, const std::vector<RankPlan>& plans) {
  json ranks = json::array();
  for (const RankPlan& p : plans) {
    json pieces = json::array();
    for (const Piece& piece : p.pieces)
      pieces.push_back({{"key", piece.key},
                        {"global_shape", piece.global_shape},
                        {"global_offset", piece.global_offset},
                        {"rows", piece.rows},
                        {"shard_row", piece.shard_row}});
    ranks.push_back({{"tp_rank", p.coord.tp_rank},
                     {"gtp_rank", p.coord.gtp_rank},
                     {"real_rows", p.real_rows},
                     {"padding_only", p.padding_only},
                     {"pieces", pieces}});
  }
  return {{"param_rows", spec.rows()}, {"shard_rows", geo.shard_rows()}, {"pad_rows", geo.pad()}, {"ranks", ranks}};
}

void print_table(const PlanFlags& f, const ParamSpec& spec, const GtpGeometry& geo, const std::vector<RankPlan>& plans) {
  std::printf("%s: %lld TP-local rows x %lld cols in %zu sections, TP %lld (split along dim %d), GTP %lld, alignment %lld\n",
              f.key.c_str(), static_cast<long long>(spec.rows()), static_cast<long long>(f.cols), spec.sections.size(),
              static_cast<long long>(f.tp), f.tp_axis, static_cast<long long>(f.gtp), static_cast<long long>(f.align));
  std::printf("  shard rows %lld, pad rows %lld, padding-only ranks %lld\n\n", static_cast<long long>(geo.shard_rows()),
              static_cast<long long>(geo.pad()), static_cast<long long>(geo.padding_only_ranks()));
  std::printf("  tp  gtp   real  pieces (key [shard rows) -> global offset)\n");
  for (const RankPlan& p : plans) {
    std::printf("  %2lld %4lld %6lld  ", static_cast<long long>(p.coord.tp_rank),
                static_cast<long long>(p.coord.gtp_rank), static_cast<long long>(p.real_rows));
    if (p.padding_only) std::printf("padding-only: saves nothing");
    for (std::size_t i = 0; i < p.pieces.size(); ++i) {
      const Piece& piece = p.pieces[i];
      std::printf("%s%s [%lld, %lld) -> %s", i ? ", " : "", piece.key.c_str(), static_cast<long long>(piece.shard_row),
                  static_cast<long long>(piece.shard_row + piece.rows), dims_text(piece.global_offset).c_str());
    }
    std::printf("\n");
  }
}

}  // namespace

Runner add_plan(CLI::App& app, Global& global) {
  auto f = std::make_shared<PlanFlags>();
  auto* cmd = app.add_subcommand("plan", "print what every rank saves of one parameter (no file is touched)");
  const auto size = CLI::Range(std::int64_t{1}, max_size);
  cmd->add_option("--model", f->model, "the parameter's layout")
      ->check(CLI::IsMember({"gdp-in-proj", "gdp-conv1d", "mamba-in-proj", "mamba-conv1d", "plain"}))
      ->capture_default_str();
  cmd->add_option("--heads", f->dims.heads, "SSM heads (global)")->check(size)->capture_default_str();
  cmd->add_option("--head-dim", f->dims.head_dim, "SSM head dimension")->check(size)->capture_default_str();
  cmd->add_option("--groups", f->dims.groups, "B/C groups (global)")->check(size)->capture_default_str();
  cmd->add_option("--state", f->dims.state, "SSM state size")->check(size)->capture_default_str();
  cmd->add_option("--householder", f->dims.householder, "GDP Householder steps")
      ->check(CLI::Range(std::int64_t{1}, max_householder))
      ->capture_default_str();
  cmd->add_option("--rows", f->rows, "TP-local rows of a plain weight")->check(size);
  cmd->add_option("--cols", f->cols, "elements per row")->required()->check(size);
  const auto parallel = CLI::Range(std::int64_t{1}, max_parallel);
  cmd->add_option("--tp", f->tp, "tensor-parallel degree")->check(parallel)->capture_default_str();
  cmd->add_option("--tp-axis", f->tp_axis, "0: TP splits rows, block by block; 1: TP splits dim 1 (plain only)")
      ->check(CLI::IsMember({0, 1}))
      ->capture_default_str();
  cmd->add_option("--gtp", f->gtp, "GTP group size")->check(parallel)->capture_default_str();
  cmd->add_option("--align", f->align, "GTP alignment in rows (0: no padding)")
      ->check(CLI::Range(std::int64_t{0}, max_align))
      ->capture_default_str();
  cmd->add_option("--key", f->key, "parameter key")->capture_default_str();
  add_json(*cmd, global);
  return [f, &global] {
    const ParamSpec spec = spec_of(*f);
    const GtpGeometry geo = GtpGeometry::make(spec.rows(), f->gtp, f->align);
    std::vector<RankPlan> plans;
    for (std::int64_t t = 0; t < f->tp; ++t)
      for (std::int64_t g = 0; g < f->gtp; ++g) plans.push_back(plan_rank(spec, f->gtp, f->align, {t, g}));
    if (global.json)
      print_json(plan_json(spec, geo, plans).dump());
    else
      print_table(*f, spec, geo, plans);
    return success;
  };
}

}  // namespace shardckpt::cli
