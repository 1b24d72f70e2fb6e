// shardckpt-bench (docs/performance.md): how fast shardckpt saves and loads, and what it costs in
// memory, next to plain I/O of the same bytes in the same run. The parts, by concern:
//   system.cpp   clocks, peak memory, the page cache, and the plain-I/O baselines
//   model.cpp    the bench model, its shards on every rank, and the report
//   writes.cpp   saves (with and without checksums, async), the gather baseline, h5py
//   reads.cpp    loads (allocating, in place, resharded, unchecked) against plain reads
//   replicas.cpp data-parallel copies: write balance and read amplification
//   device.cpp   shards in device memory (emulated or CUDA) through a copy engine
//   bounded.cpp  async saves in bounded host memory, overlapped with a simulated step
//   plan.cpp     planning at the seed's scale
//   seed.cpp     the seed's geometry with narrow rows, saved and loaded by 512 thread ranks
//   main.cpp     flags and the order of the phases
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>
import shardckpt;
import shardckpt.demo;

namespace bench {

using namespace shardckpt;
namespace fs = std::filesystem;
using json = nlohmann::json;

inline constexpr std::int64_t MiB = std::int64_t{1} << 20;

// ---- system.cpp ---------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0);
template <class Fn>
double timed(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return seconds_since(t0);
}
double median(std::vector<double> v);
double fastest(const std::vector<double>& v);
[[noreturn]] void die(const std::string& what);
// A "Name:   123 kB" line of /proc/self/status, in bytes.
std::int64_t proc_status_bytes(std::string_view field);
void remove_file(const fs::path& p);
// Runs fn(i) for i in [0, n) on every core.
void parallel_for(int n, const std::function<void(int)>& fn);

// The memory a phase adds at its peak: VmHWM after it minus VmRSS before it, with VmHWM reset by
// /proc/self/clear_refs; where that is not writable, VmRSS sampled every millisecond.
class PeakMeter {
 public:
  PeakMeter();
  const char* method() const;
  void begin();
  std::int64_t end();

 private:
  bool exact_ = false;
  std::int64_t rss0_ = 0;
  std::atomic<std::int64_t> max_{0};
  std::atomic<bool> stop_{false};
  std::thread sampler_;
};

// The same cache conditions for a subject and its baseline: everything synced and the page cache
// dropped before each (or every file of the directory evicted where drop_caches is not writable).
class Cache {
 public:
  explicit Cache(fs::path dir);
  const char* method() const;
  void cold() const;

 private:
  fs::path dir_;
  bool drop_ = false;
};

// The baselines. raw_write: one thread writes exactly the bytes the save writes, rank by rank,
// straight from the shards, then fsync. raw_read: the whole file into one fresh buffer.
// raw_read_reused: into one reused 8 MiB buffer (what the disk delivers without fresh memory).
void raw_write(const fs::path& file, const std::vector<SavePlan>& plans);
std::int64_t raw_read(const fs::path& file);
std::int64_t raw_read_reused(const fs::path& file);

// ---- model.cpp ------------------------------------------------------------------------------------

struct Options {
  int size_mib = 1024;
  bool json_out = false;
  std::string seed_phase;  // internal: one side of the seed-geometry phase, in a process of its own
  std::string dir;
  int repeat = 7;       // rounds of writes
  int read_repeat = 7;  // rounds of reads
  bool verify = true;
  bool keep = false;
  bool seed_geometry = true;    // the last phase (--no-seed-geometry skips it: the sanitized smoke test)
  std::optional<bool> h5py;
  std::string python = "/usr/bin/python3";
  std::string script;
  int dp = 4;                   // data-parallel copies of the replica phase (1: skip it)
  std::string device = "host";  // where the device phase's shards live (host: skip it)
  std::string only;             // one phase alone (seed-geometry, async-bounded), for profiling it
  int async_budget_mib = 128;   // the bounded-async phase's budget: the pool's 2 buffers of half of it
  demo::Layout save_layout{2, 4, 32, 1};
  demo::Layout load_layout{1, 8, 16, 1};
  // A 2,048-wide model with the usual 2x inner expansion (d_inner = heads * head_dim = 4,096).
  demo::ModelConfig shape{.gdp_layers = 0,
                          .mamba_layers = 0,
                          .dims = {.heads = 32, .head_dim = 128, .groups = 8, .state = 128, .householder = 2},
                          .cols = 2048,
                          .conv_kernel = 4,
                          .dtype = DType::bf16};
};

// GDP and Mamba layers (3:1) of `shape`, as many as bring the saved bytes closest to `target`.
demo::ModelConfig bench_config(demo::ModelConfig shape, std::int64_t target);
std::vector<demo::RankModel> build_models(const demo::ModelConfig& c, const demo::Layout& l,
                                          const std::function<demo::ShardMemory(int)>& placement = {});

// Every figure of a run, in order: the JSON object and the table print the same list.
class Report {
 public:
  void add(const std::string& name, double value, const std::string& note = "");
  void add(const std::string& name, double value, const std::string& target, bool met);
  void set(const std::string& key, json value);  // JSON only
  json to_json() const;
  void print_table() const;
  bool targets_met() const;

 private:
  struct Row {
    std::string name;
    double value;
    std::string target, note;
    std::optional<bool> met;
  };
  std::vector<Row> rows_;
  json extra_ = json::object();
};

// What every phase works on: the directory and its files, the model at the save layout (shards,
// plans), the cache and the memory meter.
struct Run {
  const Options& o;
  fs::path dir;
  Cache cache;
  PeakMeter meter;
  demo::ModelConfig config;
  std::vector<demo::RankModel> models;
  std::vector<SavePlan> plans;
  std::int64_t bytes = 0;  // what the save writes: every tensor once
  fs::path ckpt;           // the checkpoint the reads load
  double raw_write_gbps = 0, raw_read_gbps = 0;  // the baselines, for the device phase

  Run(const Options& options, fs::path directory);
  const demo::Layout& sl() const { return o.save_layout; }
  const demo::Layout& ll() const { return o.load_layout; }
  void progress(const std::string& what) const;
  // Peak memory may add at most this much to a save or a load in place: 1% of the bytes + 16 MiB.
  std::int64_t peak_budget() const { return bytes / 100 + 16 * MiB; }
};

void describe_model(const Run& run, Report& report);

// ---- the phases --------------------------------------------------------------------------------------

void measure_writes(Run& run, Report& report);
void measure_reads(Run& run, Report& report);
void measure_replicas(Run& run, Report& report);
// Throws Errc::device when the device phase's engine cannot be made (before any other phase runs).
void check_device(const std::string& device);
// The engine of `device` (emulated or cuda) for rank `rank`.
std::shared_ptr<CopyEngine> make_engine(const std::string& device, int rank);
void measure_device(Run& run, Report& report);
void measure_planning(Report& report);
// Bounded async saves (bounded.cpp): one rank, shards where --device says, against its own
// synchronous save and today's full staging.
void measure_async_bounded(const Options& o, const fs::path& dir, Cache& cache, PeakMeter& meter, Report& report);

// The seed's geometry (docs/performance.md, "Planning at the seed's scale"): 72 GDP layers, heads
// 512 x 128, groups 256, state 128, 4 Householder steps, TP 8 x GTP 64 (512 ranks), alignment 32;
// in_proj has 61,760 TP-local rows.
struct SeedGeometry {
  SsmDims dims{.heads = 512, .head_dim = 128, .groups = 256, .state = 128, .householder = 4};
  std::int64_t cols = 10240, align = 32;
  int layers = 72, tp = 8, gtp = 64;
  int ranks() const { return tp * gtp; }
};
// The fused weights (in_proj and conv1d) of the seed's geometry with 2 columns (406 MB of shards over
// 512 thread ranks), saved and loaded back at the same layout: peak resident memory of the process,
// and the seconds of each.
// Each side runs in a fresh process of this program (run_seed_phase, for --seed-phase save|load).
void measure_seed_geometry(const fs::path& dir, Report& report);
int run_seed_phase(const std::string& name, const fs::path& dir);

// h5py (writes.cpp): whether `python` has h5py, and one timed h5py save of the run's pieces.
bool python_has_h5py(const std::string& python);
std::optional<double> h5py_write(const Run& run, const fs::path& out, std::string& error, std::string& version);

}  // namespace bench
