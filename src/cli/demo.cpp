// shardckpt demo: build the demo model on every rank, save it, reload it at another layout and check
// every value, pad row and common value against what was saved.
module;
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

using json = nlohmann::json;

struct DemoFlags {
  std::string out;
  ModelFlags model;
  LayoutFlags save;
  TrainingFlags training;
  DeviceFlags device;
  demo::Layout load{1, 0, 8, 0};
  bool load_align_given = false;
  std::string method = "raw";
  bool no_checksums = false;
  bool phases = false;
  bool async = false;
};

// The reload layout: by default as many ranks as the save, and never the very layout that saved.
demo::Layout reload_layout(const DemoFlags& f, const demo::Layout& saved) {
  demo::Layout l = f.load;
  if (l.gtp == 0) l.gtp = std::max(1, saved.tp * saved.gtp / l.tp);
  if (!f.load_align_given && l.tp == saved.tp && l.gtp == saved.gtp && l.align == saved.align)
    l.align = saved.align == 8 ? 4 : 8;
  if (l.dp == 0) l.dp = saved.dp;
  return l;
}

struct Saved {
  double seconds = 0;
  double blocking_seconds = 0;  // how long the caller waited (the async save's staging)
  std::int64_t shard_bytes = 0, pad_rows = 0, staging_bytes = 0;
};

Saved save_model(const DemoFlags& f, const demo::ModelConfig& config, const demo::Layout& layout, const Global& g) {
  Saved out;
  std::mutex m;
  const demo::Training training = f.training.get();
  ProgressLine progress("saving ", demo::model_bytes(config, f.training.get()) / (f.save.mpi ? layout.ranks() : 1), g,
                        is_root(f.save.mpi));
  run_job(f.save.mpi, layout.ranks(), [&](ProcessGroup& group) {
    const RankDevice device = open_device(f.device.device, group.rank(), 0);  // the saver has its own pool
    demo::RankModel rank = demo::build_rank(config, layout, group.rank(), training, device.placement);
    const auto phase = [&](SavePhase p) {
      if (f.phases) std::fprintf(stderr, "shardckpt: save phase: %s\n", std::string(save_phase_name(p)).c_str());
    };
    Saver saver(group, {.engine = device.engine,
                        .staging_buffer_bytes = staging_buffer_bytes(rank.shard_bytes),
                        .reserve = f.async,  // a host save in the caller's time uses no budget
                        .save = {.method = method_of(f.method),
                                 .checksums = !f.no_checksums,
                                 .on_phase = phase,
                                 .progress = progress.callback()}});
    group.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    double blocking = 0;
    if (f.async) {
      AsyncSave pending = saver.save_async(rank.state, f.out);
      pending.wait_staged();  // what a trainer waits for before its optimizer step
      blocking = seconds_since(t0);
      pending.wait();
    } else {
      saver.save(rank.state, f.out);
    }
    const std::lock_guard lock(m);
    // Rank 0's clock, as for the save's seconds (rank 0 reports, also in an MPI job).
    if (group.rank() == 0) {
      out.seconds = seconds_since(t0);
      out.blocking_seconds = f.async ? blocking : out.seconds;
    }
    out.shard_bytes += rank.shard_bytes;
    out.pad_rows += rank.pad_rows;
    out.staging_bytes += static_cast<std::int64_t>(saver.staging_bytes());
  });
  sum_over_job(f.save.mpi, {&out.shard_bytes, &out.pad_rows, &out.staging_bytes});
  return out;
}

struct Checked {
  double seconds = 0;
  std::int64_t values = 0, pad_rows = 0, mismatches = 0;
  std::string first_mismatch;
};

Checked load_and_check(const DemoFlags& f, const CheckpointReader& reader, const demo::ModelConfig& config,
                       const demo::Layout& layout, const Global& g) {
  Checked out;
  std::mutex m;
  const demo::Training training = f.training.get();
  ProgressLine progress("loading", demo::model_bytes(config, f.training.get()) / (f.save.mpi ? layout.ranks() : 1), g,
                        is_root(f.save.mpi));
  const auto t0 = std::chrono::steady_clock::now();
  run_job(f.save.mpi, layout.ranks(), [&](ProcessGroup& group) {
    const RankDevice device =
        open_device(f.device.device, group.rank(), demo::model_bytes(config, training) / layout.ranks());
    // The model's own tensors, where they live, filled in place.
    StateDict model =
        demo::with_destinations(demo::request(config, layout, group.rank(), training), device.placement);
    const std::unique_ptr<ProcessGroup> replicas = replica_group(group, layout);
    const Values values = load_into(reader, model, group,
                                    {.method = method_of(f.method),
                                     .progress = progress.callback(),
                                     .staging = device.pool},
                                    *replicas);
    group.barrier();
    const demo::Verification v = demo::verify(config, training, group.rank(), model, values, device.engine.get());
    const std::lock_guard lock(m);
    if (group.rank() == 0) out.seconds = seconds_since(t0);
    out.values += v.values;
    out.pad_rows += v.pad_rows;
    if (v.mismatches && !out.mismatches) out.first_mismatch = v.first_mismatch;
    out.mismatches += v.mismatches;
  });
  sum_over_job(f.save.mpi, {&out.values, &out.pad_rows, &out.mismatches});
  return out;
}

void report(const DemoFlags& f, const CheckpointReader& reader, const demo::ModelConfig& config,
            const demo::Layout& saved_at, const demo::Layout& loaded_at, const Saved& s, const Checked& c,
            const Global& g) {
  const std::int64_t bytes = demo::model_bytes(config, f.training.get());
  const double save_gbps = static_cast<double>(bytes) / s.seconds / 1e9;
  const double load_gbps = static_cast<double>(bytes) / c.seconds / 1e9;
  const demo::Training training = f.training.get();
  if (g.json) {
    print_json(json{{"file", f.out},
                    {"tensors", reader.datasets().size()},
                    {"params", reader.contents().params.size()},
                    {"bytes", bytes},
                    {"checksums", reader.checksummed()},
                    {"device", f.device.device},
                    {"optimizer", f.training.optimizer},
                    {"distributed_optimizer", training.distributed},
                    {"async", f.async},
                    {"blocking_seconds", s.blocking_seconds},
                    {"staging_bytes", s.staging_bytes},
                    {"save_layout", demo::layout_json(saved_at)},
                    {"load_layout", demo::layout_json(loaded_at)},
                    {"save_seconds", s.seconds},
                    {"save_gbps", save_gbps},
                    {"load_seconds", c.seconds},
                    {"load_gbps", load_gbps},
                    {"peak_rss_bytes", demo::peak_rss_bytes()},
                    {"shard_bytes", s.shard_bytes},
                    {"pad_rows_skipped", s.pad_rows},
                    {"values_verified", c.values},
                    {"pad_rows_verified", c.pad_rows},
                    {"mismatches", c.mismatches},
                    {"verified", c.mismatches == 0},
                    {"materializations", materialization_count()}}
                   .dump());
    return;
  }
  std::printf("shardckpt demo: %d GDP + %d Mamba layers, %s, shards in %s memory%s\n", config.gdp_layers,
              config.mamba_layers, std::string(dtype_name(config.dtype)).c_str(), f.device.device.c_str(),
              training.adam ? (training.distributed ? ", Adam state (distributed optimizer)" : ", Adam state") : "");
  std::printf("  saved   %zu tensors (%zu fused/plain parameters), %s at %s in %.3f s (%.2f GB/s) -> %s\n",
              reader.datasets().size(), reader.contents().params.size(), mib_text(bytes).c_str(),
              demo::layout_text(saved_at).c_str(), s.seconds, save_gbps, f.out.c_str());
  std::printf("  pad rows skipped: %lld (never written); every row %s\n", static_cast<long long>(s.pad_rows),
              reader.checksummed() ? "checksummed (XXH3-64)" : "without checksums (--no-checksums)");
  if (f.async)
    std::printf("  async: the caller was blocked %.3f s (staging into %s of pinned memory), the save took %.3f s\n",
                s.blocking_seconds, mib_text(s.staging_bytes).c_str(), s.seconds);
  std::printf("  loaded  at %s in %.3f s (%.2f GB/s)%s\n", demo::layout_text(loaded_at).c_str(), c.seconds, load_gbps,
              reader.checksummed() ? ", every byte read checked against its checksum" : "");
  std::printf("  verified %lld values and %lld pad rows: %s\n", static_cast<long long>(c.values),
              static_cast<long long>(c.pad_rows), c.mismatches ? "MISMATCH" : "all equal");
  std::printf("  peak memory %s (model shards %s); full-tensor materializations: %llu\n",
              mib_text(demo::peak_rss_bytes()).c_str(), mib_text(s.shard_bytes).c_str(),
              static_cast<unsigned long long>(materialization_count()));
}

}  // namespace

Runner add_demo(CLI::App& app, Global& global) {
  auto f = std::make_shared<DemoFlags>();
  auto* cmd = app.add_subcommand("demo", "build the demo model, save it, reload it at another layout and verify");
  cmd->add_option("--out", f->out, "checkpoint file to write")->required();
  f->model.add(*cmd);
  f->save.add(*cmd, true);
  const auto parallel = CLI::Range(1, static_cast<int>(max_parallel));
  cmd->add_option("--load-tp", f->load.tp, "TP of the reload")->check(parallel)->capture_default_str();
  cmd->add_option("--load-gtp", f->load.gtp, "GTP of the reload (default: the save's ranks / load TP)")->check(parallel);
  cmd->add_option("--load-dp", f->load.dp, "DP of the reload (default: the save's)")->check(parallel);
  cmd->add_option("--load-align", f->load.align, "alignment of the reload (default 8, or 4 if that equals the save)")
      ->check(CLI::Range(std::int64_t{0}, max_align));
  cmd->add_flag("--no-checksums", f->no_checksums, "save without checksums (loads then cannot check what they read)");
  cmd->add_flag("--phases", f->phases, "print each phase of the save on standard error as it begins");
  cmd->add_flag("--async", f->async, "save in the background (Saver::save_async, then AsyncSave::wait_staged)");
  f->training.add(*cmd);
  f->device.add(*cmd);
  add_method(*cmd, f->method);
  add_json(*cmd, global);
  return [f, cmd, &global] {
    f->load_align_given = cmd->count("--load-align") > 0;
    const demo::ModelConfig config = f->model.get();
    const demo::Layout saved_at = f->save.resolve();
    const demo::Layout loaded_at = reload_layout(*f, saved_at);
    (void)demo::params(config, loaded_at.tp);  // a reload at a TP that is no layout of the model saves nothing
    const Saved s = save_model(*f, config, saved_at, global);
    // One open of the checkpoint per process: its ranks load through it, and the report reads it.
    const CheckpointReader reader(f->out);
    const Checked c = load_and_check(*f, reader, config, loaded_at, global);
    if (is_root(f->save.mpi)) report(*f, reader, config, saved_at, loaded_at, s, c, global);
    if (c.mismatches && is_root(f->save.mpi))
      std::cerr << "shardckpt: " << c.mismatches << " mismatches; first: " << c.first_mismatch << "\n";
    return c.mismatches ? mismatch : success;
  };
}

}  // namespace shardckpt::cli
