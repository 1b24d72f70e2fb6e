// The shardckpt command-line tool: plan, demo, load, reshard, inspect (docs/cli.md).
#include <CLI/CLI.hpp>
#ifdef SHARDCKPT_HAVE_MPI
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <variant>
#include <vector>
import shardckpt;
import shardckpt.demo;
#ifdef SHARDCKPT_HAVE_MPI
import shardckpt.dist.mpi;
#endif

using namespace shardckpt;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// ---- shared flags -------------------------------------------------------------------------------------

struct ModelFlags {
  demo::ModelConfig config;
  std::string dtype = "bf16";
  CLI::App* app = nullptr;
  void add(CLI::App& cmd) {
    app = &cmd;
    cmd.add_option("--layers", config.gdp_layers, "GDP layers")->capture_default_str();
    cmd.add_option("--mamba-layers", config.mamba_layers, "Mamba layers")->capture_default_str();
    cmd.add_option("--heads", config.dims.heads)->capture_default_str();
    cmd.add_option("--head-dim", config.dims.head_dim)->capture_default_str();
    cmd.add_option("--groups", config.dims.groups)->capture_default_str();
    cmd.add_option("--state", config.dims.state)->capture_default_str();
    cmd.add_option("--householder", config.dims.householder)->capture_default_str();
    cmd.add_option("--cols", config.cols, "hidden size")->capture_default_str();
    cmd.add_option("--dtype", dtype)->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  }
  // Fills the flags the user did not give from the checkpoint's recorded model configuration.
  void default_from(const CheckpointReader& reader) {
    const auto it = reader.contents().common.find("model_config");
    if (it == reader.contents().common.end() || !std::holds_alternative<std::string>(it->second)) return;
    const json c = json::parse(std::get<std::string>(it->second));
    auto take = [&](const char* flag, const char* field, auto& target) {
      if (app->count(flag) == 0 && c.contains(field)) target = c.at(field).get<std::decay_t<decltype(target)>>();
    };
    take("--layers", "gdp_layers", config.gdp_layers);
    take("--mamba-layers", "mamba_layers", config.mamba_layers);
    take("--heads", "heads", config.dims.heads);
    take("--head-dim", "head_dim", config.dims.head_dim);
    take("--groups", "groups", config.dims.groups);
    take("--state", "state", config.dims.state);
    take("--householder", "householder", config.dims.householder);
    take("--cols", "cols", config.cols);
    take("--dtype", "dtype", dtype);
  }
  demo::ModelConfig get() {
    config.dtype = parse_dtype(dtype);
    return config;
  }
};

struct LayoutFlags {
  demo::Layout layout{2, 2, 16, 1};
  int ranks = 0;
  bool mpi = false;
  void add(CLI::App& cmd, bool with_ranks) {
    cmd.add_option("--tp", layout.tp, "tensor-parallel degree")->capture_default_str()->check(CLI::PositiveNumber);
    cmd.add_option("--gtp", layout.gtp, "GTP group size")->capture_default_str()->check(CLI::PositiveNumber);
    cmd.add_option("--align", layout.align, "GTP alignment in rows (0: none)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    if (!with_ranks) return;
    cmd.add_option("--dp", layout.dp, "data-parallel replicas")->capture_default_str()->check(CLI::PositiveNumber);
    cmd.add_option("--ranks", ranks, "in-process ranks (default: DP x TP x GTP)")->check(CLI::PositiveNumber);
    cmd.add_flag("--mpi", mpi, "this process is one rank of an MPI job (world size = DP x TP x GTP)");
  }
  // --ranks N with N = k x TP x GTP means k replicas.
  demo::Layout resolve() {
    if (ranks > 0) {
      require(ranks % (layout.tp * layout.gtp) == 0, Errc::invalid_argument, "--ranks ", ranks,
              " is not a multiple of TP x GTP = ", layout.tp * layout.gtp);
      layout.dp = ranks / (layout.tp * layout.gtp);
    }
    return layout;
  }
};

std::string layout_text(const demo::Layout& l) {
  return cat("TP ", l.tp, " x GTP ", l.gtp, " (alignment ", l.align, ")", l.dp > 1 ? cat(" x DP ", l.dp) : "");
}

json layout_json(const demo::Layout& l) { return {{"tp", l.tp}, {"gtp", l.gtp}, {"align", l.align}, {"dp", l.dp}}; }

std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::int64_t dataset_bytes(const DatasetInfo& d) {
  return static_cast<std::int64_t>(dtype_size(d.dtype)) * element_count(d.shape);
}

std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string out = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + (dims.size() == 1 ? ",)" : ")");
}

// Runs one collective job on in-process ranks or, with --mpi, as this process's rank of MPI_COMM_WORLD.
void run_job(bool mpi, int ranks, const std::function<void(ProcessGroup&)>& fn) {
  if (!mpi) return run_ranks(ranks, fn);
#ifdef SHARDCKPT_HAVE_MPI
  MpiGroup group(MPI_COMM_WORLD);
  require(group.size() == ranks, Errc::invalid_argument, "the MPI job has ", group.size(),
          " processes but the layout needs ", ranks);
  fn(group);
#else
  throw Error(Errc::invalid_argument, "--mpi: this build has no MPI support");
#endif
}

bool is_root(bool mpi) {
#ifdef SHARDCKPT_HAVE_MPI
  if (mpi) {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank == 0;
  }
#endif
  (void)mpi;
  return true;
}

// With --mpi each process counted only its own rank: the report shows the whole job's totals.
void sum_over_job(bool mpi, std::span<std::int64_t> values) {
#ifdef SHARDCKPT_HAVE_MPI
  if (mpi)
    MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
#endif
  (void)mpi;
  (void)values;
}

// ---- load + verify, shared by demo and load -----------------------------------------------------------

struct LoadResult {
  double seconds = 0;
  std::int64_t values = 0, pad_rows = 0, mismatches = 0;
  std::string first_mismatch;
};

LoadResult load_and_verify(const fs::path& file, const demo::ModelConfig& config, const demo::Layout& layout,
                           bool mpi, IoMethod method) {
  LoadResult out;
  std::mutex m;
  const auto t0 = std::chrono::steady_clock::now();
  run_job(mpi, layout.ranks(), [&](ProcessGroup& group) {
    const LoadedState loaded = load(file, demo::request(config, layout, group.rank()), group, {method});
    group.barrier();
    const std::lock_guard lock(m);
    if (group.rank() == 0) out.seconds = seconds_since(t0);
    const demo::Verification v = demo::verify(config, layout, group.rank(), loaded);
    out.values += v.values;
    out.pad_rows += v.pad_rows;
    if (v.mismatches && !out.mismatches) out.first_mismatch = v.first_mismatch;
    out.mismatches += v.mismatches;
  });
  std::int64_t totals[3] = {out.values, out.pad_rows, out.mismatches};
  sum_over_job(mpi, totals);
  out.values = totals[0];
  out.pad_rows = totals[1];
  out.mismatches = totals[2];
  return out;
}

// ---- commands -------------------------------------------------------------------------------------------

struct PlanFlags {
  std::string model = "gdp-in-proj";
  demo::ModelConfig config;
  std::int64_t rows = 0, cols = 0;
  int tp = 1, tp_axis = 0, gtp = 1;
  std::int64_t align = 0;
  std::string key = "in_proj.weight";
  bool json_out = false;
};

int cmd_plan(const PlanFlags& f) {
  const SsmDims& d = f.config.dims;
  std::vector<Section> sections;
  if (f.model == "gdp-in-proj")
    sections = gdp_in_proj_sections(d, f.tp);
  else if (f.model == "gdp-conv1d")
    sections = gdp_conv1d_sections(d, f.tp);
  else if (f.model == "mamba-in-proj")
    sections = mamba_in_proj_sections(d, f.tp);
  else if (f.model == "mamba-conv1d")
    sections = mamba_conv1d_sections(d, f.tp);
  else if (f.model == "plain") {
    require(f.rows > 0, Errc::invalid_argument, "--model plain needs --rows (TP-local rows)");
    sections = plain_sections(f.rows);
  } else {
    throw Error(Errc::invalid_argument, cat("unknown model '", f.model, "'"));
  }
  require(f.tp_axis == 0 || f.model == "plain", Errc::invalid_argument, "--tp-axis 1 is only for --model plain");
  const ParamSpec spec{f.key, sections, {f.cols}, f.tp_axis == 1 ? TpAxis::cols : TpAxis::rows, f.tp};
  validate(spec);
  const GtpGeometry geo = GtpGeometry::make(spec.rows(), f.gtp, f.align);
  std::vector<RankPlan> plans;
  for (int t = 0; t < f.tp; ++t)
    for (int g = 0; g < f.gtp; ++g) plans.push_back(plan_rank(spec, f.gtp, f.align, {t, g}));
  if (f.json_out) {
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
    std::cout << json{{"param_rows", spec.rows()},
                      {"shard_rows", geo.shard_rows()},
                      {"pad_rows", geo.pad()},
                      {"ranks", ranks}}
                     .dump()
              << "\n";
    return 0;
  }
  std::cout << f.key << ": " << spec.rows() << " TP-local rows x " << f.cols << " cols in " << spec.sections.size()
            << " sections, TP " << f.tp << " (split along dim " << f.tp_axis << "), GTP " << f.gtp << ", alignment "
            << f.align << "\n  shard rows " << geo.shard_rows() << ", pad rows " << geo.pad() << ", padding-only ranks "
            << geo.padding_only_ranks() << "\n\n";
  std::cout << "  tp  gtp   real  pieces (key [shard rows) -> global offset)\n";
  for (const RankPlan& p : plans) {
    std::printf("  %2lld %4lld %6lld  ", static_cast<long long>(p.coord.tp_rank), static_cast<long long>(p.coord.gtp_rank),
                static_cast<long long>(p.real_rows));
    if (p.padding_only) std::cout << "padding-only: saves nothing";
    for (std::size_t i = 0; i < p.pieces.size(); ++i) {
      const Piece& piece = p.pieces[i];
      std::cout << (i ? ", " : "") << piece.key << " [" << piece.shard_row << ", " << piece.shard_row + piece.rows
                << ") -> " << dims_text(piece.global_offset);
    }
    std::cout << "\n";
  }
  return 0;
}

int cmd_demo(const fs::path& out, demo::ModelConfig config, demo::Layout save_layout, demo::Layout load_layout,
             bool mpi, IoMethod method, bool json_out) {
  const bool root = is_root(mpi);
  std::int64_t shard_bytes = 0, pad_rows = 0;
  std::mutex m;
  double save_seconds = 0;
  run_job(mpi, save_layout.ranks(), [&](ProcessGroup& group) {
    demo::RankModel rank = demo::build_rank(config, save_layout, group.rank());
    {
      const std::lock_guard lock(m);
      shard_bytes += rank.shard_bytes;
      pad_rows += rank.pad_rows;
    }
    group.barrier();
    const auto s0 = std::chrono::steady_clock::now();
    save(rank.state, out, group, {method});
    if (group.rank() == 0) save_seconds = seconds_since(s0);
  });
  std::int64_t totals[2] = {shard_bytes, pad_rows};
  sum_over_job(mpi, totals);
  shard_bytes = totals[0];
  pad_rows = totals[1];
  const LoadResult loaded = load_and_verify(out, config, load_layout, mpi, method);
  if (!root) return loaded.mismatches ? 1 : 0;
  const CheckpointReader reader(out);
  std::int64_t bytes = 0;
  for (const DatasetInfo& d : reader.datasets()) bytes += dataset_bytes(d);
  const double save_gbps = bytes / save_seconds / 1e9, load_gbps = bytes / loaded.seconds / 1e9;
  if (json_out) {
    std::cout << json{{"file", out.string()},
                      {"tensors", reader.datasets().size()},
                      {"params", reader.contents().params.size()},
                      {"bytes", bytes},
                      {"save_layout", layout_json(save_layout)},
                      {"load_layout", layout_json(load_layout)},
                      {"save_seconds", save_seconds},
                      {"save_gbps", save_gbps},
                      {"load_seconds", loaded.seconds},
                      {"load_gbps", load_gbps},
                      {"peak_rss_bytes", peak_rss_bytes()},
                      {"pad_rows_skipped", pad_rows},
                      {"values_verified", loaded.values},
                      {"pad_rows_verified", loaded.pad_rows},
                      {"mismatches", loaded.mismatches},
                      {"materializations", materialization_count()}}
                     .dump()
              << "\n";
  } else {
    std::printf("shardckpt demo: %d GDP + %d Mamba layers, %s\n", config.gdp_layers, config.mamba_layers,
                std::string(dtype_name(config.dtype)).c_str());
    std::printf("  saved   %zu tensors (%zu fused/plain parameters), %.2f MiB at %s in %.3f s (%.2f GB/s) -> %s\n",
                reader.datasets().size(), reader.contents().params.size(), bytes / 1048576.0,
                layout_text(save_layout).c_str(), save_seconds, save_gbps, out.c_str());
    std::printf("  pad rows skipped: %lld (never written)\n", static_cast<long long>(pad_rows));
    std::printf("  loaded  at %s in %.3f s (%.2f GB/s)\n", layout_text(load_layout).c_str(), loaded.seconds, load_gbps);
    std::printf("  verified %lld values and %lld pad rows: %s\n", static_cast<long long>(loaded.values),
                static_cast<long long>(loaded.pad_rows), loaded.mismatches ? "MISMATCH" : "all equal");
    std::printf("  peak memory %.1f MiB (model shards %.1f MiB); full-tensor materializations: %llu\n",
                peak_rss_bytes() / 1048576.0, shard_bytes / 1048576.0,
                static_cast<unsigned long long>(materialization_count()));
  }
  if (loaded.mismatches)
    std::cerr << "shardckpt: " << loaded.mismatches << " mismatches; first: " << loaded.first_mismatch << "\n";
  return loaded.mismatches ? 1 : 0;
}

int cmd_load(const fs::path& file, const demo::ModelConfig& config, const demo::Layout& layout, bool mpi, bool verify,
             IoMethod method, bool json_out) {
  const LoadResult r = load_and_verify(file, config, layout, mpi, method);
  const bool failed = verify && r.mismatches > 0;
  if (!is_root(mpi)) return failed ? 1 : 0;
  if (json_out) {
    std::cout << json{{"file", file.string()},
                      {"layout", layout_json(layout)},
                      {"seconds", r.seconds},
                      {"values_verified", verify ? r.values : 0},
                      {"pad_rows_verified", verify ? r.pad_rows : 0},
                      {"mismatches", verify ? r.mismatches : 0},
                      {"verified", verify}}
                     .dump()
              << "\n";
  } else {
    std::printf("loaded %s at %s in %.3f s\n", file.c_str(), layout_text(layout).c_str(), r.seconds);
    if (verify)
      std::printf("verified %lld values and %lld pad rows: %s\n", static_cast<long long>(r.values),
                  static_cast<long long>(r.pad_rows), r.mismatches ? "MISMATCH" : "all equal");
  }
  if (failed) std::cerr << "shardckpt: " << r.mismatches << " mismatches; first: " << r.first_mismatch << "\n";
  return failed ? 1 : 0;
}

// Every tensor of the input as a parameter: fused ones from their records, every other dataset as a
// plain replicated one. Datasets without rows (placeholders exist only in local files) carry no data.
std::vector<std::pair<ParamRecord, DType>> reshard_params(const CheckpointReader& in) {
  std::vector<std::pair<ParamRecord, DType>> out;
  std::set<std::string> covered;
  for (const ParamRecord& r : in.contents().params) {
    for (const Section& s : r.blocks) covered.insert(block_key(r.key, s.name));
    out.emplace_back(r, in.dataset(block_key(r.key, r.blocks.front().name)).dtype);
  }
  for (const DatasetInfo& d : in.datasets()) {
    if (covered.contains(d.key) || d.shape.empty() || d.shape[0] == 0) continue;
    out.emplace_back(
        ParamRecord{d.key, TpAxis::replicated, plain_sections(d.shape[0]), {d.shape.begin() + 1, d.shape.end()}},
        d.dtype);
  }
  return out;
}

int cmd_reshard(const fs::path& in, const fs::path& out, const demo::Layout& layout) {
  const CheckpointReader reader(in);
  const auto params = reshard_params(reader);
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(layout.tp * layout.gtp, [&](ProcessGroup& group) {
    const ShardCoord coord{group.rank() / layout.gtp, group.rank() % layout.gtp};
    StateDict request;
    for (const auto& [record, dtype] : params)
      request.add(ShardedParam{spec_at_tp(record, layout.tp), layout.gtp, layout.align, coord, dtype, 0, {}});
    const LoadedState loaded = load(in, request, group);
    StateDict state;
    for (const ShardedParam& p : request.params()) {
      ShardedParam entry = p;
      entry.shard = loaded.tensor(p.spec.key).view();
      state.add(std::move(entry));
    }
    for (const auto& [key, value] : reader.contents().common) state.add_common(key, value);
    save(state, out, group);
  });
  std::printf("resharded %s -> %s at %s: %zu parameters in %.3f s\n", in.c_str(), out.c_str(),
              layout_text(layout).c_str(), params.size(), seconds_since(t0));
  return 0;
}

int cmd_inspect(const fs::path& file, bool json_out) {
  const CheckpointReader reader(file);
  const CheckpointContents& c = reader.contents();
  std::int64_t total = 0;
  json tensors = json::array(), params = json::array(), common = json::object();
  for (const DatasetInfo& d : reader.datasets()) {
    total += dataset_bytes(d);
    tensors.push_back(
        {{"key", d.key}, {"dtype", dtype_name(d.dtype)}, {"global_shape", d.shape}, {"bytes", dataset_bytes(d)}});
  }
  for (const ParamRecord& r : c.params) {
    json blocks = json::array();
    for (const Section& s : r.blocks)
      blocks.push_back({{"name", s.name}, {"key", block_key(r.key, s.name)}, {"rows", s.rows}});
    params.push_back(
        {{"key", r.key}, {"tp_axis", tp_axis_name(r.tp_axis)}, {"trailing", r.trailing}, {"blocks", blocks}});
  }
  for (const auto& [key, value] : c.common) std::visit([&](const auto& v) { common[key] = v; }, value);
  if (json_out) {
    std::cout << json{{"file", file.string()},
                      {"format_version", format_version},
                      {"kind", c.kind == CheckpointKind::global ? "global" : "local"},
                      {"bytes", total},
                      {"tensors", tensors},
                      {"params", params},
                      {"common", common}}
                     .dump()
              << "\n";
    return 0;
  }
  std::printf("%s: %s checkpoint, %zu tensors, %.2f MiB\n", file.c_str(),
              c.kind == CheckpointKind::global ? "global" : "local", reader.datasets().size(), total / 1048576.0);
  for (const DatasetInfo& d : reader.datasets())
    std::printf("  %-56s %-5s %-20s %12lld bytes\n", d.key.c_str(), std::string(dtype_name(d.dtype)).c_str(),
                dims_text(d.shape).c_str(), static_cast<long long>(dataset_bytes(d)));
  if (!c.params.empty()) std::printf("fused layouts:\n");
  for (const ParamRecord& r : c.params) {
    std::printf("  %s (TP %s):", r.key.c_str(), std::string(tp_axis_name(r.tp_axis)).c_str());
    for (const Section& s : r.blocks)
      std::printf(" %s=%lld", s.name.empty() ? "(plain)" : s.name.c_str(), static_cast<long long>(s.rows));
    std::printf("\n");
  }
  if (!c.common.empty()) std::printf("common values:\n");
  for (const auto& [key, value] : c.common) std::printf("  %s = %s\n", key.c_str(), common[key].dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#ifdef SHARDCKPT_HAVE_MPI
  const bool want_mpi = [&] {
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]) == "--mpi") return true;
    return false;
  }();
  if (want_mpi) MPI_Init(&argc, &argv);
#endif
  CLI::App app{"shardckpt: save and load GTP-sharded tensor-parallel weights as HDF5 without gathering"};
  app.require_subcommand(1);
  app.failure_message(
      [](const CLI::App*, const CLI::Error& e) { return std::string("shardckpt: error: ") + e.what() + "\n"; });

  PlanFlags pf;
  auto* plan = app.add_subcommand("plan", "print what every rank saves of one parameter");
  plan->add_option("--model", pf.model, "gdp-in-proj|gdp-conv1d|mamba-in-proj|mamba-conv1d|plain")->required();
  plan->add_option("--heads", pf.config.dims.heads);
  plan->add_option("--head-dim", pf.config.dims.head_dim);
  plan->add_option("--groups", pf.config.dims.groups);
  plan->add_option("--state", pf.config.dims.state);
  plan->add_option("--householder", pf.config.dims.householder)->capture_default_str();
  plan->add_option("--rows", pf.rows, "TP-local rows (plain)");
  plan->add_option("--cols", pf.cols, "elements per row")->required()->check(CLI::PositiveNumber);
  plan->add_option("--tp", pf.tp)->required()->check(CLI::PositiveNumber);
  plan->add_option("--tp-axis", pf.tp_axis)->check(CLI::IsMember({0, 1}))->capture_default_str();
  plan->add_option("--gtp", pf.gtp)->required()->check(CLI::PositiveNumber);
  plan->add_option("--align", pf.align)->required()->check(CLI::NonNegativeNumber);
  plan->add_option("--key", pf.key)->capture_default_str();
  plan->add_flag("--json", pf.json_out);

  std::string method_name = "direct";
  auto add_method = [&](CLI::App* cmd) {
    cmd->add_option("--method", method_name, "write/read path")
        ->check(CLI::IsMember({"direct", "hyperslab"}))
        ->capture_default_str();
  };

  std::string demo_out;
  bool demo_json = false;
  ModelFlags demo_model;
  LayoutFlags demo_layout;
  demo::Layout load_to{1, 0, 8, 1};
  auto* demo = app.add_subcommand("demo", "build the demo model, save it, reload it at another layout and verify");
  demo->add_option("--out", demo_out, "checkpoint file to write")->required();
  demo_model.add(*demo);
  demo_layout.add(*demo, true);
  demo->add_option("--load-tp", load_to.tp, "TP of the reload")->capture_default_str()->check(CLI::PositiveNumber);
  demo->add_option("--load-gtp", load_to.gtp, "GTP of the reload (default: the save's ranks)")
      ->check(CLI::PositiveNumber);
  demo->add_option("--load-align", load_to.align, "alignment of the reload")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  demo->add_flag("--json", demo_json);
  add_method(demo);

  std::string load_file;
  bool load_verify = false, load_json = false;
  ModelFlags load_model;
  LayoutFlags load_layout;
  auto* loadc = app.add_subcommand("load", "load a checkpoint at a layout and optionally verify the demo pattern");
  loadc->add_option("file", load_file)->required();
  load_model.add(*loadc);
  load_layout.add(*loadc, true);
  loadc->add_flag("--verify", load_verify, "check every shard against the demo pattern and pad rows against zero");
  loadc->add_flag("--json", load_json);
  add_method(loadc);

  std::string rin, rout;
  LayoutFlags reshard_layout;
  auto* reshard = app.add_subcommand("reshard", "load at a layout and save again");
  reshard->add_option("in", rin)->required();
  reshard->add_option("out", rout)->required();
  reshard_layout.add(*reshard, false);

  std::string inspect_file;
  bool inspect_json = false;
  auto* inspect = app.add_subcommand("inspect", "list keys, global shapes, dtypes, bytes and fused layouts");
  inspect->add_option("file", inspect_file)->required();
  inspect->add_flag("--json", inspect_json);

  int rc = 0;
  try {
    app.parse(argc, argv);
    const IoMethod method = method_name == "hyperslab" ? IoMethod::hyperslab : IoMethod::direct;
    if (*plan) rc = cmd_plan(pf);
    if (*demo) {
      const demo::Layout save_layout = demo_layout.resolve();
      if (load_to.gtp == 0) load_to.gtp = std::max(1, save_layout.tp * save_layout.gtp / load_to.tp);
      // The demo proves resharding: never reload at the very layout that saved.
      if (demo->count("--load-align") == 0 && load_to.tp == save_layout.tp && load_to.gtp == save_layout.gtp &&
          load_to.align == save_layout.align)
        load_to.align = save_layout.align == 8 ? 4 : 8;
      load_to.dp = save_layout.dp;
      require(load_to.gtp >= 1, Errc::invalid_argument, "--load-gtp must be at least 1");
      rc = cmd_demo(demo_out, demo_model.get(), save_layout, load_to, demo_layout.mpi, method, demo_json);
    }
    if (*loadc) {
      load_model.default_from(CheckpointReader(load_file));
      rc =
          cmd_load(load_file, load_model.get(), load_layout.resolve(), load_layout.mpi, load_verify, method, load_json);
    }
    if (*reshard) rc = cmd_reshard(rin, rout, reshard_layout.layout);
    if (*inspect) rc = cmd_inspect(inspect_file, inspect_json);
  } catch (const CLI::ParseError& e) {
    rc = app.exit(e) == 0 ? 0 : 2;  // --help is no error; every usage error exits 2
  } catch (const std::exception& e) {
    std::cerr << "shardckpt: error: " << e.what() << "\n";
    rc = 2;
  }
#ifdef SHARDCKPT_HAVE_MPI
  if (want_mpi) {
    if (rc == 2) MPI_Abort(MPI_COMM_WORLD, rc);
    MPI_Finalize();
  }
#endif
  return rc;
}
