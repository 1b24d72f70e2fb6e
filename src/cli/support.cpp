// What the commands of the tool share: flag groups, jobs, the progress line (see modules/cli.cppm).
module;
#include <CLI/CLI.hpp>
#include <unistd.h>
#ifdef SHARDCKPT_HAVE_MPI
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module shardckpt.cli;
#ifdef SHARDCKPT_HAVE_MPI
import shardckpt.dist.mpi;
#endif
#ifdef SHARDCKPT_HAVE_CUDA
import shardckpt.cuda;
#endif

namespace shardckpt::cli {

void add_json(CLI::App& cmd, Global& global) {
  cmd.add_flag("--json", global.json, "print one JSON object on standard output instead of the report");
}

void add_method(CLI::App& cmd, std::string& method) {
  cmd.add_option("--method", method,
                 "raw: pwrite/pread at the datasets' file addresses, all ranks at once; hyperslab: HDF5 "
                 "hyperslab I/O (saving ranks take turns)")
      ->check(CLI::IsMember({"raw", "hyperslab"}))
      ->capture_default_str();
}

IoMethod method_of(const std::string& name) { return name == "hyperslab" ? IoMethod::hyperslab : IoMethod::raw; }

void ModelFlags::add(CLI::App& cmd) {
  const auto size = CLI::Range(std::int64_t{1}, max_size);
  cmd.add_option("--layers", config.gdp_layers, "GatedDeltaProduct layers")
      ->check(CLI::Range(0, max_layers))
      ->capture_default_str();
  cmd.add_option("--mamba-layers", config.mamba_layers, "Mamba layers after them")
      ->check(CLI::Range(0, max_layers))
      ->capture_default_str();
  cmd.add_option("--heads", config.dims.heads, "SSM heads (global)")->check(size)->capture_default_str();
  cmd.add_option("--head-dim", config.dims.head_dim, "SSM head dimension")->check(size)->capture_default_str();
  cmd.add_option("--groups", config.dims.groups, "B/C groups (global)")->check(size)->capture_default_str();
  cmd.add_option("--state", config.dims.state, "SSM state size")->check(size)->capture_default_str();
  cmd.add_option("--householder", config.dims.householder, "GDP Householder steps")
      ->check(CLI::Range(std::int64_t{1}, max_householder))
      ->capture_default_str();
  cmd.add_option("--cols", config.cols, "hidden size: the trailing dim of in_proj, the rows of out_proj")
      ->check(size)
      ->capture_default_str();
  cmd.add_option("--dtype", dtype, "element type of the weights")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
}

demo::ModelConfig ModelFlags::get() const {
  demo::ModelConfig c = config;
  c.dtype = parse_dtype(dtype);
  return c;
}

void LayoutFlags::add(CLI::App& cmd, bool replicas) {
  const auto parallel = CLI::Range(1, static_cast<int>(max_parallel));
  cmd.add_option("--tp", layout.tp, "tensor-parallel degree")->check(parallel)->capture_default_str();
  cmd.add_option("--gtp", layout.gtp, "GTP group size")->check(parallel)->capture_default_str();
  cmd.add_option("--align", layout.align, "GTP alignment in rows (0: no padding)")
      ->check(CLI::Range(std::int64_t{0}, max_align))
      ->capture_default_str();
  if (!replicas) return;
  cmd.add_option("--dp", layout.dp, "data-parallel replicas")->check(parallel)->capture_default_str();
  cmd.add_option("--ranks", ranks, "in-process ranks, a multiple k of TP x GTP (sets DP = k; default DP x TP x GTP)")
      ->check(CLI::Range(1, static_cast<int>(max_thread_ranks)));
  cmd.add_flag("--mpi", mpi, "this process is one rank of an MPI job whose size is DP x TP x GTP");
}

demo::Layout LayoutFlags::resolve() const {
  demo::Layout l = layout;
  const std::int64_t group = std::int64_t{l.tp} * l.gtp;
  if (ranks > 0) {
    require(ranks % group == 0, Errc::invalid_argument, "--ranks ", ranks, " is not a multiple of TP x GTP = ", group);
    l.dp = static_cast<int>(ranks / group);
  }
  const std::int64_t total = group * l.dp;
  require(total <= (mpi ? max_parallel * 16 : max_thread_ranks), Errc::invalid_argument, "DP x TP x GTP = ", total,
          " ranks is more than ", mpi ? max_parallel * 16 : max_thread_ranks,
          mpi ? "" : " threads of one process (use --mpi for more)");
  return l;
}

void DeviceFlags::add(CLI::App& cmd) {
  cmd.add_option("--device", device,
                 "where the shards live: host, pinned (host memory pinned for copies), emulated (a device the host "
                 "cannot touch, through a copy engine), cuda (CUDA device: rank mod devices)")
      ->check(CLI::IsMember({"host", "pinned", "emulated", "cuda"}))
      ->capture_default_str();
}

std::size_t staging_buffer_bytes(std::int64_t rank_bytes) {
  return static_cast<std::size_t>(
      std::clamp<std::int64_t>(rank_bytes, 1 << 20, static_cast<std::int64_t>(StagingPool::default_buffer_bytes)));
}

RankDevice open_device(const std::string& device, int rank, std::int64_t rank_bytes) {
  RankDevice out;
  if (device == "host") return out;
  if (device == "pinned") {
    out.placement.memory = MemoryKind::pinned;
    return out;
  }
  if (device == "emulated") {
    out.engine = std::make_shared<EmulatedDevice>();
  } else {
#ifdef SHARDCKPT_HAVE_CUDA
    const int devices = CudaEngine::devices();
    require(devices > 0, Errc::device, "--device cuda: no CUDA device is available");
    out.engine = device_engine(MemorySpace::on_device(rank % devices));  // the library's, for the device
#else
    (void)rank;
    throw Error(Errc::device, "--device cuda: this build has no CUDA support");
#endif
  }
  out.placement = {MemoryKind::device, out.engine};
  // a pool sized to the rank's bytes: thread ranks with small shards need not pin 128 MiB each
  if (rank_bytes > 0) out.pool = std::make_shared<StagingPool>(out.engine, staging_buffer_bytes(rank_bytes));
  return out;
}

void TrainingFlags::add(CLI::App& cmd) {
  cmd.add_option("--optimizer", optimizer, "optimizer state saved with the weights (adam: exp_avg, exp_avg_sq and "
                                           "fp32_param per parameter, in f32)")
      ->check(CLI::IsMember({"none", "adam"}))
      ->capture_default_str();
  cmd.add_flag("--distributed-optimizer", distributed,
               "each DP rank holds a flat range of every optimizer state shard (needs --optimizer adam)");
}

demo::Training TrainingFlags::get() const {
  require(!distributed || optimizer == "adam", Errc::invalid_argument, "--distributed-optimizer needs --optimizer adam");
  return {optimizer == "adam", distributed};
}

StateDict request_of(const CheckpointReader& reader, const demo::Layout& layout, int rank, bool distributed) {
  const demo::RankCoord c = demo::coord_of(layout, rank);
  return request_all(reader, {layout.tp, layout.gtp, layout.align, {c.tp, c.gtp}, c.dp, layout.dp, distributed});
}

void require_memory(const CheckpointReader& reader, const demo::Layout& layout, bool mpi, bool distributed) {
  std::int64_t bytes = 0;
  for (int rank = 0; rank < (mpi ? 1 : layout.ranks()); ++rank) {
    const StateDict request = request_of(reader, layout, rank, distributed);
    for (const ShardedParam& p : request.params())
      bytes = checked_add(bytes,
                          checked_mul(p.shard_shape().elements(), element_bytes(p.dtype),
                                      cat("the shard bytes of ", p.spec.key)),
                          "the shard bytes of the load");
  }
  require_host_memory(static_cast<std::uint64_t>(bytes),
                      cat("loading ", reader.path().string(), " at ", demo::layout_text(layout),
                          mpi ? "" : cat(" on ", layout.ranks(), " thread ranks")));
}

std::unique_ptr<ProcessGroup> replica_group(ProcessGroup& group, const demo::Layout& layout) {
  const demo::RankCoord c = demo::coord_of(layout, group.rank());
  return group.split(c.tp * layout.gtp + c.gtp, c.dp);
}

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

void sum_over_job(bool mpi, std::initializer_list<std::int64_t*> values) {
#ifdef SHARDCKPT_HAVE_MPI
  if (mpi) {
    std::vector<std::int64_t> sums;
    for (const std::int64_t* v : values) sums.push_back(*v);
    MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(sums.size()), MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    auto sum = sums.begin();
    for (std::int64_t* v : values) *v = *sum++;
  }
#endif
  (void)mpi;
  (void)values;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string mib_text(std::int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f MiB", static_cast<double>(bytes) / 1048576.0);
  return text;
}

void print_json(std::string_view text) { std::cout << text << "\n"; }

ProgressLine::ProgressLine(std::string_view what, std::int64_t total, const Global& global, bool root)
    : what_(what), total_(total), start_(std::chrono::steady_clock::now()), last_(start_) {
  enabled_ = root && !global.quiet && !global.json && ::isatty(STDERR_FILENO);
  // The tests see the line without waiting a second.
  if (const char* after = std::getenv("SHARDCKPT_PROGRESS_AFTER_MS")) after_ = std::chrono::milliseconds(std::atoi(after));
}

void ProgressLine::add(std::int64_t bytes) {
  if (!enabled_) return;
  const std::lock_guard lock(mutex_);
  done_ += bytes;
  const auto now = std::chrono::steady_clock::now();
  if (now - start_ < after_ || (shown_ && now - last_ < std::chrono::milliseconds(100))) return;
  last_ = now;
  shown_ = true;
  const double seconds = std::max(1e-9, std::chrono::duration<double>(now - start_).count());
  const double rate = static_cast<double>(done_) / seconds;
  const double left = rate > 0 ? static_cast<double>(std::max<std::int64_t>(0, total_ - done_)) / rate : 0;
  std::fprintf(stderr, "\r  %s %s of %s  %.2f GB/s  %.1f s left   ", what_.c_str(), mib_text(done_).c_str(),
               mib_text(total_).c_str(), rate / 1e9, left);
  std::fflush(stderr);
}

ProgressLine::~ProgressLine() {
  if (shown_) std::fprintf(stderr, "\r%*s\r", 78, "");
}

int report_error(const std::exception& e) {
  std::cerr << "shardckpt: error: " << e.what() << "\n";
  const auto* error = dynamic_cast<const Error*>(&e);
  return error && error->code() == Errc::corrupt ? mismatch : failure;
}

}  // namespace shardckpt::cli
