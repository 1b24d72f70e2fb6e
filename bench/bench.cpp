// shardckpt-bench: how fast shardckpt saves and loads, and what a save costs in memory, next to
// plain sequential I/O of the same bytes, the old gather-then-split save, and h5py hyperslab writes
// (docs/performance.md). One run, one machine, one directory, one set of bytes.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using json = nlohmann::json;
namespace fs = std::filesystem;

#ifndef SHARDCKPT_BENCH_SCRIPT
#define SHARDCKPT_BENCH_SCRIPT "bench/h5py_compare.py"
#endif

namespace {

constexpr std::int64_t MiB = std::int64_t{1} << 20;

// ---- clocks, /proc and the page cache ---------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <class Fn>
double timed(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return seconds_since(t0);
}

[[noreturn]] void die(const std::string& what) { throw Error(Errc::io, cat(what, ": ", std::strerror(errno))); }

// A "Name:   123 kB" line of /proc/self/status, in bytes.
std::int64_t proc_status_bytes(std::string_view field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(field.size())) * 1024;
  return 0;
}

bool write_proc(const char* file, const char* text) {
  const int fd = ::open(file, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text, std::strlen(text)) == static_cast<ssize_t>(std::strlen(text));
  ::close(fd);
  return ok;
}

// The memory a phase adds to the process at its peak: VmHWM after the phase minus VmRSS before it,
// with VmHWM reset to VmRSS by /proc/self/clear_refs at the start. Where clear_refs is not writable
// a thread samples VmRSS every millisecond instead (which can miss a short peak).
class PeakMeter {
 public:
  PeakMeter() { exact_ = write_proc("/proc/self/clear_refs", "5"); }
  const char* method() const { return exact_ ? "VmHWM reset by /proc/self/clear_refs" : "VmRSS sampled every 1 ms"; }

  void begin() {
    ::malloc_trim(0);  // freed heap of earlier phases must not be reused silently by this one
    rss0_ = proc_status_bytes("VmRSS:");
    if (exact_) {
      if (!write_proc("/proc/self/clear_refs", "5")) die("resetting VmHWM");
      return;
    }
    max_ = rss0_;
    stop_ = false;
    sampler_ = std::thread([this] {
      while (!stop_) {
        max_ = std::max<std::int64_t>(max_, proc_status_bytes("VmRSS:"));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  std::int64_t end() {
    std::int64_t peak = 0;
    if (exact_) {
      peak = proc_status_bytes("VmHWM:");
    } else {
      stop_ = true;
      sampler_.join();
      peak = std::max<std::int64_t>(max_, proc_status_bytes("VmRSS:"));
    }
    return std::max<std::int64_t>(0, peak - rss0_);
  }

 private:
  bool exact_ = false;
  std::int64_t rss0_ = 0;
  std::atomic<std::int64_t> max_{0};
  std::atomic<bool> stop_{false};
  std::thread sampler_;
};

// Same cache conditions for a subject and its baseline: before every phase, everything is synced
// and the page cache dropped (or, where /proc/sys/vm/drop_caches is not writable, every file of the
// run is evicted with posix_fadvise(DONTNEED) after fdatasync).
class Cache {
 public:
  explicit Cache(fs::path dir) : dir_(std::move(dir)) {
    ::sync();
    drop_ = write_proc("/proc/sys/vm/drop_caches", "3");
  }
  const char* method() const { return drop_ ? "sync + echo 3 > /proc/sys/vm/drop_caches" : "fdatasync + posix_fadvise(DONTNEED)"; }
  void cold() const {
    ::sync();
    if (drop_ && write_proc("/proc/sys/vm/drop_caches", "3")) return;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      if (!e.is_regular_file()) continue;
      const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }

 private:
  fs::path dir_;
  bool drop_ = false;
};

void remove_file(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
  fs::remove(partial_path(p), ec);
}

void write_all(int fd, const std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t done = ::write(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (done < 0 && errno == EINTR) continue;
    if (done <= 0) die("raw write");
    p += done;
    n -= static_cast<std::size_t>(done);
  }
}

// ---- the model ----------------------------------------------------------------------------------------

std::int64_t saved_bytes(const demo::ModelConfig& c) {
  std::int64_t n = 0;
  for (const ParamSpec& spec : demo::params(c, 1))
    for (const Block& b : blocks(spec)) n += static_cast<std::int64_t>(dtype_size(c.dtype)) * element_count(b.global_shape);
  return n;
}

// The bench model: GDP and Mamba layers (3:1) of the given shape, as many as make the bytes closest
// to the target; where even two layers are too many, the hidden size shrinks instead.
demo::ModelConfig bench_config(demo::ModelConfig c, std::int64_t target) {
  auto with_layers = [&](int layers) {
    c.gdp_layers = layers - layers / 4;
    c.mamba_layers = layers / 4;
    return saved_bytes(c);
  };
  while (c.cols > 256 && with_layers(2) > target) c.cols /= 2;
  int best = 1;
  std::int64_t best_gap = INT64_MAX;
  for (int layers = 1; layers < 100000; ++layers) {
    const std::int64_t b = with_layers(layers);
    const std::int64_t gap = std::abs(b - target);
    if (gap < best_gap) best_gap = gap, best = layers;
    if (b > target) break;
  }
  with_layers(best);
  return c;
}

std::vector<demo::RankModel> build_models(const demo::ModelConfig& c, const demo::Layout& l) {
  std::vector<demo::RankModel> models(static_cast<std::size_t>(l.ranks()));
  std::atomic<int> next{0};
  std::vector<std::thread> workers;
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned w = 0; w < n; ++w)
    workers.emplace_back([&] {
      for (int r; (r = next++) < l.ranks();) models[static_cast<std::size_t>(r)] = demo::build_rank(c, l, r);
    });
  for (auto& w : workers) w.join();
  return models;
}

// ---- the phases -------------------------------------------------------------------------------------

// Plain sequential writes of exactly the bytes the save writes (each rank's pieces, rank by rank,
// straight from the shards), one file, then fsync.
void raw_write(const fs::path& file, const std::vector<SavePlan>& plans) {
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) die("open " + file.string());
  for (const SavePlan& plan : plans)
    for (const SaveItem& i : plan.items)
      if (i.writes) write_all(fd, i.data.data(), i.data.bytes());
  if (::fsync(fd) != 0) die("fsync " + file.string());
  ::close(fd);
}

// Plain sequential reads of the whole checkpoint file into fresh memory (as a load reads into
// freshly allocated shards).
std::int64_t raw_read(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) die("open " + file.string());
  struct stat st {};
  if (::fstat(fd, &st) != 0) die("stat " + file.string());
  const auto size = static_cast<std::size_t>(st.st_size);
  HostBuffer buf = HostBuffer::uninitialized(DType::u8, {static_cast<std::int64_t>(size)});
  std::byte* p = buf.mut_view().data();
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, p + done, std::min<std::size_t>(size - done, std::size_t{8} << 20));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) die("read " + file.string());
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return static_cast<std::int64_t>(size);
}

// The same, into one reused 8 MiB buffer: what the disk and the page cache deliver without the cost
// of faulting in fresh memory.
std::int64_t raw_read_reused(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) die("open " + file.string());
  HostBuffer buf = HostBuffer::uninitialized(DType::u8, {std::int64_t{8} << 20});
  std::byte* p = buf.mut_view().data();
  std::memset(p, 0, buf.bytes());
  std::int64_t done = 0;
  for (;;) {
    const ssize_t n = ::read(fd, p, buf.bytes());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) die("read " + file.string());
    if (n == 0) break;
    done += n;
  }
  ::close(fd);
  return done;
}

struct LoadRun {
  double seconds = 0;
  std::int64_t peak_extra = 0;
  std::int64_t mismatches = 0;
  std::int64_t values = 0;
  std::string first_mismatch;
};

LoadRun timed_load(const fs::path& file, const demo::ModelConfig& c, const demo::Layout& l, PeakMeter& meter, bool verify) {
  std::vector<StateDict> requests;
  for (int r = 0; r < l.ranks(); ++r) requests.push_back(demo::request(c, l, r));
  std::vector<std::optional<LoadedState>> loaded(static_cast<std::size_t>(l.ranks()));
  LoadRun out;
  meter.begin();
  out.seconds = timed([&] {
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      loaded[static_cast<std::size_t>(g.rank())].emplace(load(file, requests[static_cast<std::size_t>(g.rank())], g));
    });
  });
  out.peak_extra = meter.end();
  if (verify) {
    std::vector<demo::Verification> v(static_cast<std::size_t>(l.ranks()));
    std::atomic<int> next{0};
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < std::max(1u, std::thread::hardware_concurrency()); ++w)
      workers.emplace_back([&] {
        for (int r; (r = next++) < l.ranks();)
          v[static_cast<std::size_t>(r)] = demo::verify(c, {}, r, requests[static_cast<std::size_t>(r)], *loaded[static_cast<std::size_t>(r)]);
      });
    for (auto& w : workers) w.join();
    for (const auto& x : v) {
      if (x.mismatches && !out.mismatches) out.first_mismatch = x.first_mismatch;
      out.mismatches += x.mismatches;
      out.values += x.values;
    }
  }
  return out;
}

// ---- planning at the seed's scale ---------------------------------------------------------------------

struct PlanFigures {
  SsmDims dims;
  std::int64_t rows = 0, cols = 0;
  int layers = 0, tp = 0, gtp = 0;
  std::int64_t align = 0;
  std::size_t blocks = 0;
  double us_per_rank = 0;           // plan_rank of the 72 in_proj weights of one rank
  double pieces_per_rank = 0;
  double full_us_per_rank = 0;      // prepare_save + claims_of of one rank's whole state dict
  std::size_t world_claims = 0;
  std::int64_t world_claims_bytes = 0;  // memory the world's claims take as Claim values, all at once
  std::int64_t world_claims_encoded_bytes = 0;  // the same claims as rank 0 receives them in a save
  std::int64_t rank0_part_bytes = 0;    // Claim values rank 0 holds at a time (parts of 16k claims)
  std::int64_t rank_bytes = 0;          // bytes rank 0 saves at the seed's scale
  double validate_ms = 0;           // validate_claims of every rank's claims (rank 0, once per save)
};

PlanFigures plan_seed_scale() {
  PlanFigures f;
  // H = 4 householder steps: (H + 1) * (dI + gS + nH) = 5 * (8192 + 4096 + 64) = 61,760 TP-local rows.
  f.dims = {.heads = 512, .head_dim = 128, .groups = 256, .state = 128, .householder = 4};
  f.cols = 10240;
  f.layers = 72;
  f.tp = 8;
  f.gtp = 64;
  f.align = 32;
  std::vector<ParamSpec> specs;
  for (int layer = 0; layer < f.layers; ++layer)
    specs.push_back({cat("decoder.layers.", layer, ".mixer.in_proj.weight"), gdp_in_proj_sections(f.dims, f.tp), {f.cols},
                     TpAxis::rows, f.tp});
  f.rows = specs[0].rows();
  f.blocks = specs[0].sections.size();
  require(f.rows == 61760, Errc::layout, "the seed dims give ", f.rows, " TP-local rows, not 61,760");
  const int ranks = f.tp * f.gtp;
  double best = 1e30;
  std::size_t pieces = 0;
  for (int rep = 0; rep < 5; ++rep) {
    pieces = 0;
    const double s = timed([&] {
      for (int t = 0; t < f.tp; ++t)
        for (int g = 0; g < f.gtp; ++g)
          for (const ParamSpec& spec : specs) pieces += plan_rank(spec, f.gtp, f.align, {t, g}).pieces.size();
    });
    best = std::min(best, s);
  }
  f.us_per_rank = best * 1e6 / ranks;
  f.pieces_per_rank = static_cast<double>(pieces) / ranks;

  // The whole save planning of one rank of the seed model (72 GDP layers: in_proj, conv1d, out_proj,
  // norm), with shards borrowed from no memory: prepare_save never touches data.
  demo::ModelConfig seed;
  seed.gdp_layers = f.layers;
  seed.mamba_layers = 0;
  seed.dims = f.dims;
  seed.cols = f.cols;
  const std::vector<ParamSpec> all = demo::params(seed, f.tp);
  ::malloc_trim(0);
  const std::int64_t rss0 = proc_status_bytes("VmRSS:");
  std::vector<Claim> claims;
  double full = 0;
  std::int64_t rank0_bytes = 0;
  for (int r = 0; r < ranks; ++r) {
    StateDict state;
    for (const ParamSpec& spec : all) {
      ShardedParam p{spec, f.gtp, f.align, {r / f.gtp, r % f.gtp}, DType::bf16};
      // Planning never touches the bytes: a borrow of no memory is enough.
      p.shard = unchecked_borrow(TensorView::borrow(nullptr, DType::bf16, p.shard_shape()));
      state.add(std::move(p));
    }
    std::vector<Claim> mine;
    full += timed([&] {
      const SavePlan plan = prepare_save(state);
      mine = claims_of(plan, r);
      if (r == 0)
        for (const SaveItem& i : plan.items) rank0_bytes += static_cast<std::int64_t>(i.data.bytes());
    });
    claims.insert(claims.end(), std::make_move_iterator(mine.begin()), std::make_move_iterator(mine.end()));
  }
  f.full_us_per_rank = full * 1e6 / ranks;
  f.world_claims = claims.size();
  claims.shrink_to_fit();
  f.world_claims_bytes = proc_status_bytes("VmRSS:") - rss0;
  f.rank_bytes = rank0_bytes;
  // What rank 0 holds in a save: every rank's claims as sent (src/dist.cpp's encoding: key, dtype,
  // three dim lists, replica flag) and one part of them at a time as Claim values.
  for (const Claim& c : claims)
    f.world_claims_encoded_bytes += static_cast<std::int64_t>(8 + c.key.size() + 1 + 3 * (8 + 8 * c.global_shape.size()) + 1);
  f.rank0_part_bytes = f.world_claims_bytes * std::min<std::int64_t>(16 * 1024, static_cast<std::int64_t>(claims.size())) /
                       static_cast<std::int64_t>(claims.size());
  f.validate_ms = timed([&] { validate_claims(claims); }) * 1e3;
  return f;
}

// ---- h5py -------------------------------------------------------------------------------------------

bool python_has_h5py(const std::string& python) {
  if (!fs::exists(python)) return false;
  return std::system((python + " -c 'import h5py, numpy' >/dev/null 2>&1").c_str()) == 0;
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// Every main-replica piece of every rank, and every dataset, for bench/h5py_compare.py.
json piece_plan(const std::vector<SavePlan>& plans) {
  json datasets = json::object(), pieces = json::array();
  for (std::size_t r = 0; r < plans.size(); ++r)
    for (const SaveItem& i : plans[r].items) {
      if (!i.writes) continue;
      datasets[i.key] = {{"shape", i.global_shape}, {"dtype", dtype_name(i.dtype)}};
      // Dims past 1 are never split: the box's columns are whole elements of dim 1.
      const std::int64_t inner = element_count(std::span(i.global_shape).subspan(std::min<std::size_t>(2, i.global_shape.size())));
      std::vector<std::int64_t> offset(i.global_shape.size(), 0), count = i.global_shape;
      offset[0] = i.box.rows.begin;
      count[0] = i.box.rows.size();
      if (i.global_shape.size() > 1) {
        offset[1] = i.box.cols.begin / inner;
        count[1] = i.box.cols.size() / inner;
      }
      pieces.push_back({{"key", i.key}, {"offset", offset}, {"count", count}, {"dtype", dtype_name(i.dtype)}, {"rank", r}});
    }
  json ds = json::array();
  for (auto& [key, d] : datasets.items()) ds.push_back({{"key", key}, {"shape", d["shape"]}, {"dtype", d["dtype"]}});
  return {{"datasets", ds}, {"pieces", pieces}};
}

std::optional<json> run_h5py(const std::string& python, const std::string& script, const fs::path& plan, const fs::path& out,
                             std::string& error) {
  const fs::path result = out.string() + ".result.json";
  const std::string cmd = cat(python, " ", shell_quote(script), " ", shell_quote(plan.string()), " ", shell_quote(out.string()),
                              " > ", shell_quote(result.string()), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(result);
  std::stringstream text;
  text << in.rdbuf();
  std::error_code ec;
  fs::remove(result, ec);
  if (rc != 0) {
    error = cat("h5py script failed (", rc, "): ", text.str());
    return std::nullopt;
  }
  try {
    std::string s = text.str();
    return json::parse(s.substr(s.rfind('{')));
  } catch (const std::exception& e) {
    error = cat("h5py script printed no result: ", text.str());
    return std::nullopt;
  }
}

// ---- figures ----------------------------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Options {
  int size_mib = 1024;
  bool json_out = false;
  std::string dir;
  int repeat = 7;       // rounds of writes
  int read_repeat = 7;  // rounds of reads
  bool verify = true;
  bool keep = false;
  std::optional<bool> h5py;
  std::string python = "/usr/bin/python3";
  std::string script = SHARDCKPT_BENCH_SCRIPT;
  demo::Layout save_layout{2, 4, 32, 1};
  demo::Layout load_layout{1, 8, 16, 1};
  // A 2,048-wide model with the usual 2x inner expansion (d_inner = heads * head_dim = 4,096).
  demo::ModelConfig shape{.gdp_layers = 0, .mamba_layers = 0,
                           .dims = {.heads = 32, .head_dim = 128, .groups = 8, .state = 128, .householder = 2},
                           .cols = 2048, .conv_kernel = 4, .dtype = DType::bf16};
};

int run(const Options& o) {
  // Every buffer of 1 MiB or more gets its own mapping and goes back to the system when freed: no
  // phase then inherits memory that an earlier one faulted in (glibc would otherwise raise its mmap
  // threshold after the first large free and keep freed shards resident in thread arenas, which
  // malloc_trim does not release), and the peak memory of each phase is its own.
  ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  // --- where, what, how
  fs::path dir;
  bool own_dir = false;
  if (o.dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "shardckpt-bench-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) die("mkdtemp");
    dir = tmpl;
    own_dir = true;
  } else {
    dir = o.dir;
    fs::create_directories(dir);
  }
  const fs::path raw_file = dir / "raw.bin", ckpt = dir / "shardckpt.h5", gather_file = dir / "gather.h5",
                 h5py_file = dir / "h5py.h5", plan_file = dir / "pieces.json";
  // Leaves nothing behind, however the run ends (unless --keep).
  struct Cleanup {
    const Options& o;
    std::vector<fs::path> files;
    fs::path dir;
    ~Cleanup() {
      if (o.keep) return;
      for (const fs::path& p : files) remove_file(p);
      std::error_code ec;
      if (!dir.empty()) fs::remove(dir, ec);
    }
  } cleanup{o, {raw_file, ckpt, gather_file, h5py_file, plan_file}, own_dir ? dir : fs::path()};
  const Cache cache(dir);
  PeakMeter meter;
  const bool use_h5py = o.h5py.value_or(python_has_h5py(o.python));
  const demo::ModelConfig config = bench_config(o.shape, std::int64_t{o.size_mib} * MiB);
  const demo::Layout& sl = o.save_layout;
  const demo::Layout& ll = o.load_layout;
  auto progress = [&](const std::string& s) {
    if (!o.json_out) std::fprintf(stderr, "  %s\n", s.c_str());
  };

  progress(cat("building ", config.gdp_layers, " GDP + ", config.mamba_layers, " Mamba layers at ", demo::layout_text(sl)));
  std::vector<demo::RankModel> models = build_models(config, sl);
  std::int64_t shard_bytes = 0, pad_rows = 0;
  std::vector<SavePlan> plans;
  for (const auto& m : models) {
    shard_bytes += m.shard_bytes;
    pad_rows += m.pad_rows;
    plans.push_back(prepare_save(m.state));
  }
  // Pieces, and how many belong to row-parallel weights (TP on dim 1): those datasets are stored
  // chunked one TP band wide, so such a piece is one contiguous write like any other.
  std::int64_t bytes = 0, row_parallel_pieces = 0, row_parallel_bytes = 0;
  std::size_t pieces = 0;
  for (const SavePlan& p : plans)
    for (const SaveItem& i : p.items) {
      if (!i.writes || i.data.empty()) continue;
      bytes += static_cast<std::int64_t>(i.data.bytes());
      ++pieces;
      if (i.box.cols.size() < element_count(std::span(i.global_shape).subspan(1))) {
        ++row_parallel_pieces;
        row_parallel_bytes += static_cast<std::int64_t>(i.data.bytes());
      }
    }
  require(bytes == saved_bytes(config), Errc::invalid_argument, "the pieces hold ", bytes, " bytes, the model ", saved_bytes(config));
  if (use_h5py) {
    std::ofstream(plan_file) << piece_plan(plans).dump();
  }

  std::vector<double> raw_w, save_w, gather_w, h5py_w, raw_r, raw_reused_r, load_r, reshard_r;
  std::int64_t save_peak = 0, gather_peak = 0, gather_rank_peak = 0, raw_peak = 0, load_peak = 0, reshard_peak = 0;
  std::int64_t load_mismatch = 0, reshard_mismatch = 0, verified_values = 0;
  std::string first_mismatch, h5py_error, h5py_version;
  double raw_read_bytes = 0;

  // Writes: every subject and baseline in turn, round after round. Before each, its file of the
  // last round is deleted, everything is synced and the page cache dropped; each ends with fsync.
  for (int rep = 0; rep < o.repeat; ++rep) {
    progress(cat("round ", rep + 1, " of ", o.repeat, ": writes"));
    remove_file(raw_file);
    cache.cold();
    meter.begin();
    raw_w.push_back(timed([&] { raw_write(raw_file, plans); }));
    raw_peak = std::max(raw_peak, meter.end());

    remove_file(ckpt);
    cache.cold();
    meter.begin();
    save_w.push_back(timed([&] {
      run_ranks(sl.ranks(), [&](ProcessGroup& g) {
        save(models[static_cast<std::size_t>(g.rank())].state, ckpt, g, {IoMethod::direct});
      });
    }));
    save_peak = std::max(save_peak, meter.end());

    remove_file(gather_file);
    cache.cold();
    meter.begin();
    gather_w.push_back(timed([&] { gather_rank_peak = demo::gather_save(config, sl, models, gather_file); }));
    gather_peak = std::max(gather_peak, meter.end());

    if (use_h5py) {
      remove_file(h5py_file);
      cache.cold();
      if (const auto r = run_h5py(o.python, o.script, plan_file, h5py_file, h5py_error)) {
        h5py_w.push_back(r->at("seconds").get<double>());
        h5py_version = r->value("h5py", "");
        if (r->at("bytes").get<std::int64_t>() != bytes)
          h5py_error = cat("h5py wrote ", r->at("bytes").get<std::int64_t>(), " bytes, not ", bytes);
      }
    }
  }
  if (!o.keep)
    for (const fs::path& p : {raw_file, gather_file, h5py_file}) remove_file(p);

  // Reads of the last checkpoint saved. The first read of a freshly written file can run at another
  // speed than later ones (the disk of a virtual machine has caches of its own below the page cache),
  // so one untimed read comes first; then every subject and baseline in turn, each from a dropped
  // page cache, round after round.
  cache.cold();
  (void)raw_read(ckpt);
  for (int rep = 0; rep < o.read_repeat; ++rep) {
    progress(cat("round ", rep + 1, " of ", o.read_repeat, ": reads"));
    cache.cold();
    raw_r.push_back(timed([&] { raw_read_bytes = static_cast<double>(raw_read(ckpt)); }));

    cache.cold();
    raw_reused_r.push_back(timed([&] { (void)raw_read_reused(ckpt); }));

    // A load at `layout` from a cold cache, checked against the pattern in the first round.
    auto load_at = [&](const demo::Layout& layout, std::vector<double>& seconds, std::int64_t& peak,
                       std::int64_t& mismatches) {
      cache.cold();
      const LoadRun l = timed_load(ckpt, config, layout, meter, o.verify && rep == 0);
      seconds.push_back(l.seconds);
      peak = std::max(peak, l.peak_extra);
      mismatches += l.mismatches;
      verified_values += l.values;
      if (l.mismatches && first_mismatch.empty()) first_mismatch = l.first_mismatch;
    };
    load_at(sl, load_r, load_peak, load_mismatch);
    load_at(ll, reshard_r, reshard_peak, reshard_mismatch);
  }
  const std::int64_t file_bytes = static_cast<std::int64_t>(fs::file_size(ckpt));
  if (!o.keep) remove_file(ckpt);

  progress("planning at the seed's scale");
  const PlanFigures plan = plan_seed_scale();

  // --- figures
  const double gb = static_cast<double>(bytes) / 1e9;
  const double raw_write_gbps = gb / median(raw_w), save_gbps = gb / median(save_w), gather_gbps = gb / median(gather_w);
  const double raw_read_gbps = raw_read_bytes / 1e9 / median(raw_r), load_gbps = gb / median(load_r),
               reshard_gbps = gb / median(reshard_r);
  const double save_ratio = save_gbps / raw_write_gbps, load_ratio = load_gbps / raw_read_gbps,
               reshard_ratio = reshard_gbps / raw_read_gbps;
  const double raw_read_reused_gbps = raw_read_bytes / 1e9 / median(raw_reused_r);
  // The same ratios from each side's fastest round, for a noisy machine.
  const auto best = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  const double save_ratio_best = best(raw_w) / best(save_w),
               load_ratio_best = gb / best(load_r) / (raw_read_bytes / 1e9 / best(raw_r)),
               reshard_ratio_best = gb / best(reshard_r) / (raw_read_bytes / 1e9 / best(raw_r));
  const std::int64_t peak_budget = bytes / 100 + 16 * MiB;
  const std::int64_t loaded_shards_save = shard_bytes;
  std::int64_t loaded_shards_reshard = 0;
  for (int r = 0; r < ll.ranks(); ++r) {
    const StateDict request = demo::request(config, ll, r);
    for (const ShardedParam& p : request.params())
      loaded_shards_reshard += p.shard_shape().elements() * static_cast<std::int64_t>(dtype_size(config.dtype));
  }

  struct Target {
    const char* figure;
    double value;
    std::string target;
    bool met;
  };
  const std::vector<Target> targets = {
      {"save_ratio", save_ratio, ">= 0.9", save_ratio >= 0.9},
      {"load_ratio", load_ratio, ">= 0.9", load_ratio >= 0.9},
      {"reshard_ratio", reshard_ratio, ">= 0.8", reshard_ratio >= 0.8},
      {"save_peak_extra_bytes", static_cast<double>(save_peak), cat("<= ", peak_budget, " (1% + 16 MiB)"), save_peak <= peak_budget},
      {"plan_seed_scale_us_per_rank", plan.us_per_rank, "<= 1000", plan.us_per_rank <= 1000},
  };
  bool all_met = true;
  for (const Target& t : targets) all_met = all_met && t.met;

  json out = {
      {"bytes", bytes},
      {"file_bytes", file_bytes},
      {"shard_bytes", shard_bytes},
      {"pad_rows_not_written", pad_rows},
      {"pieces", pieces},
      {"row_parallel_pieces", row_parallel_pieces},
      {"row_parallel_bytes", row_parallel_bytes},
      {"ranks", sl.ranks()},
      {"reshard_ranks", ll.ranks()},
      {"save_layout", demo::layout_json(sl)},
      {"reshard_layout", demo::layout_json(ll)},
      {"model", {{"gdp_layers", config.gdp_layers}, {"mamba_layers", config.mamba_layers}, {"heads", config.dims.heads},
                 {"head_dim", config.dims.head_dim}, {"groups", config.dims.groups}, {"state", config.dims.state},
                 {"householder", config.dims.householder}, {"cols", config.cols}, {"dtype", dtype_name(config.dtype)},
                 {"tensors", plans.empty() ? 0 : demo::params(config, 1).size()}}},
      {"repeat", o.repeat},
      {"read_repeat", o.read_repeat},
      {"directory", dir.string()},
      {"cache", cache.method()},
      {"peak_memory_method", meter.method()},
      {"allocator", "glibc malloc, M_MMAP_THRESHOLD fixed at 1 MiB"},
      {"raw_write_gbps", raw_write_gbps},
      {"save_gbps", save_gbps},
      {"save_ratio", save_ratio},
      {"gather_save_gbps", gather_gbps},
      {"save_peak_extra_bytes", save_peak},
      {"save_peak_extra_budget_bytes", peak_budget},
      {"gather_peak_extra_bytes", gather_peak},
      {"gather_peak_per_rank_bytes", gather_rank_peak},
      {"gather_peak_all_ranks_bytes", gather_rank_peak * sl.ranks()},
      {"raw_write_peak_extra_bytes", raw_peak},
      {"raw_read_gbps", raw_read_gbps},
      {"raw_read_reused_buffer_gbps", raw_read_reused_gbps},
      {"load_gbps", load_gbps},
      {"load_ratio", load_ratio},
      {"reshard_load_gbps", reshard_gbps},
      {"reshard_ratio", reshard_ratio},
      {"load_peak_extra_bytes", load_peak},
      {"load_shard_bytes", loaded_shards_save},
      {"reshard_peak_extra_bytes", reshard_peak},
      {"reshard_shard_bytes", loaded_shards_reshard},
      {"verified_values", verified_values},
      {"mismatches", load_mismatch + reshard_mismatch},
      {"best_round_ratios", {{"save_ratio", save_ratio_best}, {"load_ratio", load_ratio_best}, {"reshard_ratio", reshard_ratio_best}}},
      {"seconds", {{"raw_read_reused_buffer", raw_reused_r}, {"raw_write", raw_w}, {"save", save_w}, {"gather_save", gather_w}, {"h5py_write", h5py_w}, {"raw_read", raw_r},
                   {"load", load_r}, {"reshard_load", reshard_r}}},
      {"plan_seed_scale_us_per_rank", plan.us_per_rank},
      {"plan_seed_scale",
       {{"layers", plan.layers}, {"tp", plan.tp}, {"gtp", plan.gtp}, {"align", plan.align}, {"in_proj_rows", plan.rows},
        {"in_proj_cols", plan.cols}, {"in_proj_blocks", plan.blocks}, {"heads", plan.dims.heads}, {"head_dim", plan.dims.head_dim},
        {"groups", plan.dims.groups}, {"state", plan.dims.state}, {"householder", plan.dims.householder},
        {"pieces_per_rank", plan.pieces_per_rank}, {"prepare_save_all_params_us_per_rank", plan.full_us_per_rank},
        {"world_claims", plan.world_claims}, {"world_claims_bytes", plan.world_claims_bytes},
        {"world_claims_encoded_bytes", plan.world_claims_encoded_bytes}, {"rank0_part_bytes", plan.rank0_part_bytes},
        {"rank_bytes", plan.rank_bytes},
        {"validate_claims_ms", plan.validate_ms}}},
      {"targets_met", all_met},
  };
  if (use_h5py) {
    if (h5py_w.empty()) {
      out["h5py_error"] = h5py_error;
    } else {
      out["h5py_write_gbps"] = gb / median(h5py_w);
      out["h5py_version"] = h5py_version;
      if (!h5py_error.empty()) out["h5py_error"] = h5py_error;
    }
  }

  if (o.json_out) {
    std::cout << out.dump() << "\n";
  } else {
    auto mib = [](std::int64_t b) { return cat(b / MiB, ".", (b % MiB) * 10 / MiB, " MiB"); };
    std::printf("shardckpt-bench: %s (%lld bytes in %zu pieces, %lld pad rows not written; shards %s)\n",
                mib(bytes).c_str(), static_cast<long long>(bytes), pieces, static_cast<long long>(pad_rows), mib(shard_bytes).c_str());
    std::printf("  model: %d GDP + %d Mamba layers, hidden %lld, heads %lld x %lld, groups %lld, state %lld, householder %lld, bf16\n",
                config.gdp_layers, config.mamba_layers, static_cast<long long>(config.cols), static_cast<long long>(config.dims.heads),
                static_cast<long long>(config.dims.head_dim), static_cast<long long>(config.dims.groups),
                static_cast<long long>(config.dims.state), static_cast<long long>(config.dims.householder));
    std::printf("  %lld of the pieces belong to row-parallel weights (%s), stored chunked by TP band\n",
                static_cast<long long>(row_parallel_pieces), mib(row_parallel_bytes).c_str());
    std::printf("  save at %s; reshard load at %s; thread ranks in one process\n", demo::layout_text(sl).c_str(), demo::layout_text(ll).c_str());
    std::printf("  directory %s; cache: %s; peak memory: %s\n  figures: medians of %d write and %d read rounds\n\n",
                dir.c_str(), cache.method(), meter.method(), o.repeat, o.read_repeat);
    std::printf("  %-32s %16s   %-28s %s\n", "figure", "value", "target", "met");
    auto row = [](const char* name, const std::string& value, const std::string& target = "", const char* met = "") {
      std::printf("  %-32s %16s   %-28s %s\n", name, value.c_str(), target.c_str(), met);
    };
    auto num = [](double v, int prec = 3) {
      char b[64];
      std::snprintf(b, sizeof b, "%.*f", prec, v);
      return std::string(b);
    };
    auto met = [&](std::string_view name) {
      for (const Target& t : targets)
        if (t.figure == name) return t.met ? "yes" : "NO";
      return "";
    };
    auto target = [&](std::string_view name) {
      for (const Target& t : targets)
        if (t.figure == name) return t.target;
      return std::string();
    };
    row("raw_write_gbps", num(raw_write_gbps));
    row("save_gbps", num(save_gbps));
    row("save_ratio", num(save_ratio), target("save_ratio"), met("save_ratio"));
    row("gather_save_gbps", num(gather_gbps));
    if (out.contains("h5py_write_gbps")) row("h5py_write_gbps", num(out["h5py_write_gbps"].get<double>()));
    else if (use_h5py) row("h5py_write_gbps", "failed");
    else row("h5py_write_gbps", "skipped");
    row("save_peak_extra_bytes", cat(save_peak), target("save_peak_extra_bytes"), met("save_peak_extra_bytes"));
    row("gather_peak_extra_bytes", cat(gather_peak), "(ranks gather in turn here)");
    row("gather_peak_per_rank_bytes", cat(gather_rank_peak), cat("(x ", sl.ranks(), " ranks at once: ", gather_rank_peak * sl.ranks(), ")"));
    row("raw_read_gbps", num(raw_read_gbps));
    row("raw_read_reused_buffer_gbps", num(raw_read_reused_gbps), "(no target: see docs)");
    row("load_gbps", num(load_gbps));
    row("load_ratio", num(load_ratio), target("load_ratio"), met("load_ratio"));
    row("reshard_load_gbps", num(reshard_gbps));
    row("reshard_ratio", num(reshard_ratio), target("reshard_ratio"), met("reshard_ratio"));
    row("load_peak_extra_bytes", cat(load_peak), cat("(shards loaded: ", loaded_shards_save, ")"));
    row("reshard_peak_extra_bytes", cat(reshard_peak), cat("(shards loaded: ", loaded_shards_reshard, ")"));
    row("plan_seed_scale_us_per_rank", num(plan.us_per_rank, 1), target("plan_seed_scale_us_per_rank"),
        met("plan_seed_scale_us_per_rank"));
    std::printf("\n  seed-scale plan: %d layers, in_proj %lld x %lld bf16 TP-local (heads %lld, head_dim %lld, groups %lld, state %lld,"
                " householder %lld: %zu blocks), TP %d x GTP %d, alignment %lld; %.2f pieces per rank\n",
                plan.layers, static_cast<long long>(plan.rows), static_cast<long long>(plan.cols),
                static_cast<long long>(plan.dims.heads), static_cast<long long>(plan.dims.head_dim),
                static_cast<long long>(plan.dims.groups), static_cast<long long>(plan.dims.state),
                static_cast<long long>(plan.dims.householder), plan.blocks, plan.tp, plan.gtp,
                static_cast<long long>(plan.align), plan.pieces_per_rank);
    std::printf("  whole-model save planning per rank (prepare_save of %d params): %.1f us; the %zu claims of all %d ranks\n"
                "  reach rank 0 as %s and are validated there, 16384 at a time (%s of Claim values; all at once: %s, %.1f ms);\n"
                "  rank 0 saves %s there, so its budget is %s\n",
                plan.layers * 4, plan.full_us_per_rank, plan.world_claims, plan.tp * plan.gtp,
                mib(plan.world_claims_encoded_bytes).c_str(), mib(plan.rank0_part_bytes).c_str(),
                mib(plan.world_claims_bytes).c_str(), plan.validate_ms, mib(plan.rank_bytes).c_str(),
                mib(plan.rank_bytes / 100 + 16 * MiB).c_str());
    if (o.verify)
      std::printf("  verified %lld loaded values against the pattern: %s\n", static_cast<long long>(verified_values),
                  load_mismatch + reshard_mismatch ? "MISMATCH" : "all equal");
    std::printf("  ratios from each side's fastest round: save %.3f, load %.3f, reshard %.3f\n", save_ratio_best, load_ratio_best,
                reshard_ratio_best);
    if (!h5py_error.empty()) std::printf("  h5py: %s\n", h5py_error.c_str());
    std::printf("  targets: %s\n", all_met ? "all met" : "NOT all met");
  }
  if (load_mismatch + reshard_mismatch) {
    std::cerr << "shardckpt-bench: " << load_mismatch + reshard_mismatch << " mismatches; first: " << first_mismatch << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardckpt-bench: save and load throughput, save memory and planning time (docs/performance.md)"};
  Options o;
  bool h5py_on = false, h5py_off = false, no_verify = false;
  app.add_option("--size-mib", o.size_mib, "bytes to save, in MiB (the model is scaled to them)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--json", o.json_out, "print one JSON object instead of a table");
  app.add_option("--dir", o.dir, "directory for the files (default: a fresh one under $TMPDIR or /tmp)");
  app.add_option("--repeat", o.repeat, "rounds of writes; each figure is the median")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--read-repeat", o.read_repeat, "rounds of reads; each figure is the median")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--no-verify", no_verify, "skip checking the loaded values against the pattern (untimed)");
  app.add_flag("--keep", o.keep, "keep the files");
  app.add_flag("--h5py", h5py_on, "run the h5py comparison (default: when the python has h5py)");
  app.add_flag("--no-h5py", h5py_off, "skip the h5py comparison");
  app.add_option("--python", o.python, "python with h5py")->capture_default_str();
  app.add_option("--h5py-script", o.script, "the comparison script")->capture_default_str();
  app.add_option("--tp", o.save_layout.tp, "TP of the save")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--gtp", o.save_layout.gtp, "GTP of the save")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--align", o.save_layout.align, "alignment of the save")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--load-tp", o.load_layout.tp, "TP of the reshard load")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--load-gtp", o.load_layout.gtp, "GTP of the reshard load")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--load-align", o.load_layout.align, "alignment of the reshard load")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--hidden", o.shape.cols, "hidden size of the bench model")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--heads", o.shape.dims.heads, "SSM heads (d_inner = heads x head-dim)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--head-dim", o.shape.dims.head_dim, "head dimension")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--groups", o.shape.dims.groups, "B/C groups")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--state", o.shape.dims.state, "state size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--householder", o.shape.dims.householder, "GDP householder steps")->capture_default_str()->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (h5py_on) o.h5py = true;
  if (h5py_off) o.h5py = false;
  o.verify = !no_verify;
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "shardckpt-bench: error: " << e.what() << "\n";
    return 2;
  }
}
