// shardckpt load: load every tensor of any checkpoint at a layout, planned from the checkpoint's own
// parameter records, checking every byte read against its checksum; --verify also checks that every
// pad row is zero and, for a checkpoint the demo wrote, every value against the demo pattern.
module;
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

using json = nlohmann::json;

struct LoadFlags {
  std::string file;
  LayoutFlags layout;
  DeviceFlags device;
  std::string method = "raw";
  bool verify = false;
  bool no_checksums = false;
  bool bypass_page_cache = false;
  bool distributed = false;
};

struct Outcome {
  double seconds = 0;
  std::int64_t bytes = 0, values = 0, pad_rows = 0, mismatches = 0;
  std::string first_mismatch;
  Values common;  // what rank 0's load returned
};

// Common values as JSON: an int64 as an integer, a double as a number, a string as a string.
json common_json(const Values& values) {
  json out = json::object();
  for (const auto& [key, value] : values) std::visit([&](const auto& v) { out[key] = v; }, value);
  return out;
}

std::int64_t shard_bytes(const StateDict& request) {
  std::int64_t n = 0;
  for (const ShardedParam& p : request.params())
    n += p.shard_shape().elements() * element_bytes(p.dtype);
  return n;
}

Outcome run(const LoadFlags& f, const demo::Layout& layout, const CheckpointReader& reader,
            const std::optional<demo::ModelConfig>& demo_model, const Global& g) {
  Outcome out;
  std::mutex m;
  std::int64_t model = 0;
  for (const Dataset& d : reader.datasets())
    model += element_count(d.shape) * element_bytes(d.dtype);
  ProgressLine progress("loading", model / (f.layout.mpi ? layout.ranks() : 1), g, is_root(f.layout.mpi));
  const auto t0 = std::chrono::steady_clock::now();
  run_job(f.layout.mpi, layout.ranks(), [&](ProcessGroup& group) {
    const RankDevice device = open_device(f.device.device, group.rank(), model / layout.ranks());
    StateDict model =
        demo::with_destinations(request_of(reader, layout, group.rank(), f.distributed), device.placement);
    const std::unique_ptr<ProcessGroup> replicas = replica_group(group, layout);
    Values loaded = load_into(reader, model, group,
                    {.method = method_of(f.method),
                     .verify_checksums = !f.no_checksums,
                     .expect_id = reader.contents().id,
                     .progress = progress.callback(),
                     .staging = device.pool,
                     .bypass_page_cache = f.bypass_page_cache},
                    *replicas);
    group.barrier();
    const demo::Verification v =
        f.verify ? demo::verify_tensors(model, group.rank(), device.engine.get(), demo_model.has_value())
                 : demo::Verification{};
    const std::lock_guard lock(m);
    if (group.rank() == 0) {
      out.seconds = seconds_since(t0);
      out.common = std::move(loaded);
    }
    out.bytes += shard_bytes(model);
    out.values += v.values;
    out.pad_rows += v.pad_rows;
    if (v.mismatches && !out.mismatches) out.first_mismatch = v.first_mismatch;
    out.mismatches += v.mismatches;
  });
  sum_over_job(f.layout.mpi, {&out.bytes, &out.values, &out.pad_rows, &out.mismatches});
  return out;
}

// The --json report.
json report_json(const LoadFlags& f, const demo::Layout& layout, const Outcome& o, bool checksums, bool pattern,
                 bool verified) {
  return {{"file", f.file},
          {"layout", demo::layout_json(layout)},
          {"device", f.device.device},
          {"distributed_optimizer", f.distributed},
          {"seconds", o.seconds},
          {"bytes", o.bytes},
          {"checksums_checked", checksums},
          {"pattern_checked", pattern},
          {"values_verified", o.values},
          {"pad_rows_verified", o.pad_rows},
          {"mismatches", o.mismatches},
          {"verified", verified},
          {"common", common_json(o.common)}};
}

}  // namespace

Runner add_load(CLI::App& app, Global& global) {
  auto f = std::make_shared<LoadFlags>();
  auto* cmd = app.add_subcommand("load", "load every tensor of a checkpoint at a layout, checking what is read");
  cmd->add_option("file", f->file, "checkpoint to load")->required();
  f->layout.add(*cmd, true);
  f->device.add(*cmd);
  cmd->add_flag("--distributed-optimizer", f->distributed,
                "load the optimizer state (optimizer.state.*) in each DP rank's flat range, as a distributed "
                "optimizer holds it");
  cmd->add_flag("--verify", f->verify,
                "also check that pad rows are zero and, for a demo checkpoint, every value against the pattern");
  cmd->add_flag("--no-checksums", f->no_checksums, "do not check the bytes read against their checksums");
  cmd->add_flag("--bypass-page-cache", f->bypass_page_cache,
                "read tensor data around the page cache (O_DIRECT) where the file system allows");
  add_method(*cmd, f->method);
  add_json(*cmd, global);
  return [f, &global] {
    const demo::Layout layout = f->layout.resolve();
    const CheckpointReader reader(f->file);
    require_memory(reader, layout, f->layout.mpi, f->distributed);
    const std::optional<demo::ModelConfig> demo_model = demo::config_of(reader.contents());
    const bool checksums = reader.checksummed() && !f->no_checksums;
    const Outcome o = run(*f, layout, reader, demo_model, global);
    // Verified: every byte read was checked against its checksum or the pattern, and all agreed.
    const bool verified = o.mismatches == 0 && (checksums || (f->verify && demo_model));
    if (!is_root(f->layout.mpi)) return o.mismatches ? mismatch : success;
    if (global.json) {
      print_json(report_json(*f, layout, o, checksums, f->verify && demo_model.has_value(), verified).dump());
    } else {
      std::printf("loaded %s (%s of shards) at %s in %.3f s\n", f->file.c_str(), mib_text(o.bytes).c_str(),
                  demo::layout_text(layout).c_str(), o.seconds);
      std::printf("  checksums: %s\n", checksums                ? "every byte read matched"
                                       : reader.checksummed() ? "not checked (--no-checksums)"
                                       : reader.version() < 2 ? "none in this checkpoint (written before they existed)"
                                                              : "none in this checkpoint (saved without them)");
      if (f->verify)
        std::printf("  verified %lld values against the demo pattern and %lld pad rows: %s\n",
                    static_cast<long long>(o.values), static_cast<long long>(o.pad_rows),
                    o.mismatches ? "MISMATCH" : demo_model ? "all equal" : "pad rows zero (not a demo checkpoint)");
    }
    if (o.mismatches) std::cerr << "shardckpt: " << o.mismatches << " mismatches; first: " << o.first_mismatch << "\n";
    if (f->verify && !verified && !o.mismatches)
      std::cerr << "shardckpt: nothing to verify against: " << f->file
                << " has no checksums (or they were skipped) and is not a demo checkpoint\n";
    return verified || (!f->verify && !o.mismatches) ? success : mismatch;
  };
}

}  // namespace shardckpt::cli
