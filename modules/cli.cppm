// shardckpt.cli: the `shardckpt` command-line tool (docs/cli.md), one file per command under
// src/cli/, and what the commands share: flag groups with their ranges, running a job on thread
// ranks or as one rank of an MPI job, the progress line, and the exit codes. Not part of the library.
module;
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>
namespace CLI {
class App;
}
export module shardckpt.cli;
import shardckpt;
import shardckpt.demo;

export namespace shardckpt::cli {

// 0: done; 1: a verification found bytes or values that differ from what was saved; 2: an error
// (usage, a bad layout, not a checkpoint, I/O...).
enum Exit : int { success = 0, mismatch = 1, failure = 2 };

// Flags every command takes.
struct Global {
  bool quiet = false;
  bool json = false;
};

// Each command adds its subcommand (flags, defaults, help) and returns what runs it once parsed.
using Runner = std::function<int()>;
Runner add_plan(CLI::App& app, Global& global);
Runner add_demo(CLI::App& app, Global& global);
Runner add_load(CLI::App& app, Global& global);
Runner add_verify(CLI::App& app, Global& global);
Runner add_reshard(CLI::App& app, Global& global);
Runner add_inspect(CLI::App& app, Global& global);
Runner add_adopt(CLI::App& app, Global& global);

// ---- what the commands share (src/cli/support.cpp) ------------------------------------------------

// Bounds of numeric flags: past them a flag is a usage error, not an overflow or a hang.
inline constexpr std::int64_t max_parallel = 1 << 16;      // one of TP, GTP, DP
inline constexpr std::int64_t max_thread_ranks = 4096;     // ranks as threads of this process
inline constexpr std::int64_t max_plan_ranks = 1 << 20;    // TP x GTP that `plan` prints
inline constexpr std::int64_t max_align = std::int64_t{1} << 30;
inline constexpr std::int64_t max_size = std::int64_t{1} << 40;  // rows, columns, model sizes
inline constexpr std::int64_t max_householder = 1024;
inline constexpr int max_layers = 4096;

void add_json(CLI::App& cmd, Global& global);
void add_method(CLI::App& cmd, std::string& method);
IoMethod method_of(const std::string& name);

// The demo model's flags.
struct ModelFlags {
  demo::ModelConfig config;
  std::string dtype = "bf16";
  void add(CLI::App& cmd);
  demo::ModelConfig get() const;
};

// A layout: TP, GTP, alignment, and where `replicas` is set, DP, --ranks and --mpi.
struct LayoutFlags {
  demo::Layout layout{2, 2, 16, 1};
  int ranks = 0;
  bool mpi = false;
  void add(CLI::App& cmd, bool replicas);
  // The layout with --ranks applied (N = k x TP x GTP means DP k); checks the rank count.
  demo::Layout resolve() const;
};

// --device: where the shards live (host, pinned, emulated, cuda); loads fill them in place.
struct DeviceFlags {
  std::string device = "host";
  void add(CLI::App& cmd);
};

// One rank's memory: the engine of its device (none for host memory), where its shards go, and the
// pinned pool that loads into device memory stream through.
struct RankDevice {
  std::shared_ptr<CopyEngine> engine;
  demo::ShardMemory placement;
  std::shared_ptr<StagingPool> pool;
};
// `rank` picks the CUDA device (rank modulo the devices), whose engine is the library's
// (device_engine); an emulated device is the tool's own. For loads (rank_bytes > 0) the pool has two
// buffers of staging_buffer_bytes(rank_bytes). Throws Errc::device without a CUDA device.
RankDevice open_device(const std::string& device, int rank, std::int64_t rank_bytes);
// Pinned buffers of 64 MiB, or less for a rank whose shards are smaller (the demo's are small, and
// each thread rank would otherwise pin 128 MiB).
std::size_t staging_buffer_bytes(std::int64_t rank_bytes);

// --optimizer and --distributed-optimizer.
struct TrainingFlags {
  std::string optimizer = "none";
  bool distributed = false;
  void add(CLI::App& cmd);
  demo::Training get() const;
};

// The request of thread rank (or MPI rank) `rank` for every tensor of `reader` at `layout`.
StateDict request_of(const CheckpointReader& reader, const demo::Layout& layout, int rank, bool distributed);
// Refuses (Errc::resources, naming the bytes) a load whose shards, on all the ranks this process
// runs (one with --mpi), need more host memory than the process can have: before anything is
// allocated, not when a rank runs out of it.
void require_memory(const CheckpointReader& reader, const demo::Layout& layout, bool mpi, bool distributed);

// The group of this rank's data-parallel copies (its TP and GTP ranks at every DP rank), ranked by
// DP rank (collective over `group`).
std::unique_ptr<ProcessGroup> replica_group(ProcessGroup& group, const demo::Layout& layout);

// Runs one collective job on `ranks` thread ranks or, with `mpi`, as this process's rank of
// MPI_COMM_WORLD (whose size must be `ranks`).
void run_job(bool mpi, int ranks, const std::function<void(ProcessGroup&)>& fn);
// True on the process that reports (rank 0 of an MPI job, or this process).
bool is_root(bool mpi);
// With `mpi`, each process counted only its own ranks: the sums over the job replace the values.
void sum_over_job(bool mpi, std::initializer_list<std::int64_t*> values);

double seconds_since(std::chrono::steady_clock::time_point t0);
std::string mib_text(std::int64_t bytes);
// Prints one JSON document (built by the command) on standard output.
void print_json(std::string_view text);

// "saving  412.0 MiB of 1009.6 MiB  1.93 GB/s  0.3 s left" on standard error, rewritten in place,
// for work that lasts longer than about a second; only on a terminal, never with --quiet or --json.
// add() may be called from many ranks at once.
class ProgressLine {
 public:
  ProgressLine(std::string_view what, std::int64_t total, const Global& global, bool root = true);
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;
  ~ProgressLine();
  void add(std::int64_t bytes);
  BytesDone callback() {
    return [this](std::int64_t bytes) { add(bytes); };
  }

 private:
  std::string what_;
  std::int64_t total_ = 0, done_ = 0;
  bool enabled_ = false, shown_ = false;
  std::chrono::steady_clock::time_point start_, last_;
  std::chrono::milliseconds after_{1000};
  std::mutex mutex_;
};

// The exit code of a command that failed with `e`, after printing it: Errc::corrupt is a
// verification failure (1), everything else an error (2).
int report_error(const std::exception& e);

}  // namespace shardckpt::cli
