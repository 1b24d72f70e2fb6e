// shardckpt-bench: flags, and the phases in order (docs/performance.md). The exit code is 0 whatever
// the figures (a benchmark, not a test) and 1 only if a loaded value differs from the pattern.
#include <CLI/CLI.hpp>
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

#include "bench.hpp"

#ifndef SHARDCKPT_BENCH_SCRIPT
#define SHARDCKPT_BENCH_SCRIPT "bench/h5py_compare.py"
#endif

namespace bench {
namespace {

void add_flags(CLI::App& app, Options& o, bool& h5py_on, bool& h5py_off, bool& no_verify) {
  const auto positive = CLI::Range(1, 1 << 16);
  app.add_option("--size-mib", o.size_mib, "bytes to save, in MiB (the model is scaled to them)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_flag("--json", o.json_out, "print one JSON object instead of a table");
  app.add_option("--dir", o.dir, "directory for the files (default: a fresh one under $TMPDIR or /tmp)");
  app.add_option("--repeat", o.repeat, "rounds of writes; each figure is the median")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--read-repeat", o.read_repeat, "rounds of reads")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_flag("--no-verify", no_verify, "skip checking the loaded values against the pattern (untimed)");
  app.add_flag("--keep", o.keep, "keep the files");
  app.add_flag("!--no-seed-geometry", o.seed_geometry, "skip the last phase, the seed's geometry at 512 thread ranks");
  app.add_flag("--h5py", h5py_on, "run the h5py comparison (default: when the python has h5py)");
  app.add_flag("--no-h5py", h5py_off, "skip the h5py comparison");
  app.add_option("--python", o.python, "python with h5py")->capture_default_str();
  app.add_option("--h5py-script", o.script, "the comparison script")->capture_default_str();
  app.add_option("--dp", o.dp, "data-parallel copies of the replica phase (1: skip it)")->capture_default_str()->check(CLI::Range(1, 64));
  app.add_option("--device", o.device, "where the device phase's shards live (host: skip it)")
      ->capture_default_str()->check(CLI::IsMember({"host", "emulated", "cuda"}));
  app.add_option("--only", o.only, "run one phase alone")->check(CLI::IsMember({"seed-geometry", "async-bounded"}));
  app.add_option("--async-budget-mib", o.async_budget_mib,
                 "the bounded-async phase's host budget (its pool: 2 buffers of half of it; 128: the default)")
      ->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--seed-phase", o.seed_phase)->check(CLI::IsMember({"save", "load"}))->group("");  // internal
  app.add_option("--tp", o.save_layout.tp, "TP of the save")->capture_default_str()->check(positive);
  app.add_option("--gtp", o.save_layout.gtp, "GTP of the save")->capture_default_str()->check(positive);
  app.add_option("--align", o.save_layout.align, "alignment of the save")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--load-tp", o.load_layout.tp, "TP of the reshard load")->capture_default_str()->check(positive);
  app.add_option("--load-gtp", o.load_layout.gtp, "GTP of the reshard load")->capture_default_str()->check(positive);
  app.add_option("--load-align", o.load_layout.align, "alignment of the reshard load")->capture_default_str()->check(CLI::Range(0, 1 << 20));
  app.add_option("--hidden", o.shape.cols, "hidden size of the bench model")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  app.add_option("--heads", o.shape.dims.heads, "SSM heads (d_inner = heads x head-dim)")->capture_default_str()->check(positive);
  app.add_option("--head-dim", o.shape.dims.head_dim, "head dimension")->capture_default_str()->check(positive);
  app.add_option("--groups", o.shape.dims.groups, "B/C groups")->capture_default_str()->check(positive);
  app.add_option("--state", o.shape.dims.state, "state size")->capture_default_str()->check(positive);
  app.add_option("--householder", o.shape.dims.householder, "GDP householder steps")->capture_default_str()->check(CLI::Range(1, 1024));
}

// A fresh directory (removed at the end) unless one is given.
struct Directory {
  fs::path path;
  bool own = false;
  bool keep = false;
  explicit Directory(const Options& o) : keep(o.keep) {
    if (!o.dir.empty()) {
      fs::create_directories(o.dir);
      path = o.dir;
      return;
    }
    std::string tmpl = (fs::temp_directory_path() / "shardckpt-bench-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) die("mkdtemp");
    path = tmpl;
    own = true;
  }
  ~Directory() {
    if (keep) return;
    remove_file(path / "shardckpt.h5");
    std::error_code ec;
    if (own) fs::remove_all(path, ec);
  }
};

void print_header(const Run& run, const json& j) {
  std::printf("shardckpt-bench: %.1f MiB (%lld bytes in %lld pieces, %lld pad rows not written)\n",
              static_cast<double>(run.bytes) / MiB, static_cast<long long>(run.bytes), j["pieces"].get<long long>(),
              j["pad_rows_not_written"].get<long long>());
  const demo::ModelConfig& c = run.config;
  std::printf("  model: %d GDP + %d Mamba layers, hidden %lld, heads %lld x %lld, groups %lld, state %lld, householder %lld, %s\n",
              c.gdp_layers, c.mamba_layers, static_cast<long long>(c.cols), static_cast<long long>(c.dims.heads),
              static_cast<long long>(c.dims.head_dim), static_cast<long long>(c.dims.groups),
              static_cast<long long>(c.dims.state), static_cast<long long>(c.dims.householder),
              std::string(dtype_name(c.dtype)).c_str());
  std::printf("  save at %s; reshard at %s; replica phase DP %d; device phase: %s; thread ranks in one process\n",
              demo::layout_text(run.sl()).c_str(), demo::layout_text(run.ll()).c_str(), run.o.dp, run.o.device.c_str());
  std::printf("  directory %s; cache: %s; peak memory: %s\n  figures: medians of %d write and %d read rounds\n\n",
              run.dir.c_str(), run.cache.method(), run.meter.method(), run.o.repeat, run.o.read_repeat);
}

int run(const Options& o) {
  // Every buffer of 1 MiB or more gets its own mapping and goes back to the system when freed: no
  // phase then inherits memory an earlier one faulted in, and each phase's peak is its own.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  if (!o.seed_phase.empty()) return run_seed_phase(o.seed_phase, o.dir);
  check_device(o.device);
  const Directory dir(o);
  if (!o.only.empty()) {
    Report report;
    if (o.only == "seed-geometry") {
      measure_seed_geometry(dir.path, report);
    } else {
      Cache cache(dir.path);
      PeakMeter meter;
      measure_async_bounded(o, dir.path, cache, meter, report);
    }
    if (o.json_out)
      std::cout << report.to_json().dump() << "\n";
    else
      report.print_table();
    const json j = report.to_json();
    return j.value("seed_geometry_mismatches", 0.0) + j.value("async_bounded_mismatches", 0.0) > 0 ? 1 : 0;
  }
  Run run(o, dir.path);
  Report report;
  describe_model(run, report);
  measure_writes(run, report);
  measure_reads(run, report);
  measure_replicas(run, report);
  measure_device(run, report);
  run.progress("async saves in bounded host memory");
  measure_async_bounded(o, run.dir, run.cache, run.meter, report);
  run.progress("planning at the seed's scale");
  measure_planning(report);
  if (o.seed_geometry) {
    run.progress("the seed's geometry with narrow rows at 512 thread ranks");
    measure_seed_geometry(run.dir, report);
  }
  const json j = report.to_json();
  if (o.json_out) {
    std::cout << j.dump() << "\n";
  } else {
    print_header(run, j);
    report.print_table();
    std::printf("  targets: %s\n", report.targets_met() ? "all met" : "NOT all met");
  }
  const double mismatches = j.value("mismatches", 0.0) + j.value("replica_mismatches", 0.0) +
                            j.value("device_mismatches", 0.0) + j.value("seed_geometry_mismatches", 0.0) +
                            j.value("async_bounded_mismatches", 0.0);
  if (mismatches > 0) std::cerr << "shardckpt-bench: loaded values differ from the pattern\n";
  return mismatches > 0 ? 1 : 0;
}

}  // namespace
}  // namespace bench

int main(int argc, char** argv) {
  CLI::App app{"shardckpt-bench: save and load throughput and memory next to plain I/O (docs/performance.md)"};
  bench::Options o;
  o.script = SHARDCKPT_BENCH_SCRIPT;
  bool h5py_on = false, h5py_off = false, no_verify = false;
  bench::add_flags(app, o, h5py_on, h5py_off, no_verify);
  CLI11_PARSE(app, argc, argv);
  if (h5py_on) o.h5py = true;
  if (h5py_off) o.h5py = false;
  o.verify = !no_verify;
  try {
    return bench::run(o);
  } catch (const std::exception& e) {
    std::cerr << "shardckpt-bench: error: " << e.what() << "\n";
    return 2;
  }
}
