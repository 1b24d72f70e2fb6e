// Async saves in bounded host memory (--only async-bounded; also in a full run). One rank holds the
// whole model, as one GPU's process holds its shards, in the memory --device names (host, or device
// memory through a copy engine). Each round: the synchronous save; then, for W = 0, 0.5, 1 and 2
// times the synchronous save's seconds, save_async, a simulated step (W seconds of busy compute on
// the caller's thread), wait_staged(), wait(); and today's full staging (a budget of the rank's
// bytes) at W = 0. Blocking time is what the caller spends in save_async and wait_staged.
#include <algorithm>
#include <array>

#include "bench.hpp"

namespace bench {
namespace {

constexpr std::array<double, 4> windows = {0, 0.5, 1, 2};     // times the synchronous save
constexpr std::array<const char*, 4> window_names = {"w0", "w0_5", "w1", "w2"};

// Busy compute on the calling thread for `seconds` (a trainer's forward and backward).
void busy(double seconds) {
  const auto end = Clock::now() + std::chrono::duration<double>(seconds);
  volatile std::uint64_t x = 1;
  while (Clock::now() < end)
    for (int i = 0; i < 4096; ++i) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
}

struct Phase {
  const Options& o;
  fs::path dir, file;
  Cache& cache;
  PeakMeter& meter;
  demo::ModelConfig config;
  demo::Layout layout{1, 1, 0, 1};
  std::shared_ptr<CopyEngine> engine;
  demo::RankModel model;
  std::size_t budget = 0, rank_bytes = 0, pieces = 0;

  SaverOptions bounded() const {
    return {.engine = engine, .staging_buffer_bytes = budget / 2};
  }
  // Today's full staging: a budget that holds every byte of the rank (each piece rounded to 64 bytes).
  SaverOptions full() const {
    SaverOptions s = bounded();
    s.async_host_bytes = rank_bytes + 64 * pieces;
    return s;
  }
};

struct Timing {
  double blocking = 0, total = 0;
};

// One async save from a cold cache with a compute window of `window` seconds between save_async and
// wait_staged().
Timing async_round(Phase& p, Saver& saver, double window) {
  remove_file(p.file);
  p.cache.cold();
  const auto t0 = Clock::now();
  AsyncSave pending = saver.save_async(p.model.state, p.file);
  const double returned = seconds_since(t0);
  busy(window);
  const auto t1 = Clock::now();
  pending.wait_staged();
  const double staged = seconds_since(t1);
  pending.wait();
  return {returned + staged, seconds_since(t0)};
}

double sync_round(Phase& p, Saver& saver) {
  remove_file(p.file);
  p.cache.cold();
  return timed([&] { saver.save(p.model.state, p.file); });
}

// The memory one save adds, its saver's budget included: a fresh saver, one save at W = 0.
std::int64_t peak_of(Phase& p, const SaverOptions& options) {
  remove_file(p.file);
  p.cache.cold();
  p.meter.begin();
  {
    SoloGroup solo;
    Saver saver(solo, options);
    (void)async_round(p, saver, 0);
  }
  return p.meter.end();
}

std::int64_t mismatches_of(Phase& p) {
  SoloGroup solo;
  StateDict dst = demo::with_destinations(demo::request(p.config, p.layout, 0));
  const Values values = load_into(p.file, dst, solo);
  return demo::verify(p.config, {}, 0, dst, values).mismatches;
}

struct Results {
  std::vector<double> sync, full_blocking, full_total;
  std::array<std::vector<double>, windows.size()> blocking, total;
  std::size_t budget = 0;  // as the bounded saver reports it
};

void rounds(Phase& p, Results& r, const std::function<void(const std::string&)>& progress) {
  SoloGroup solo;
  Saver bounded(solo, p.bounded()), full(solo, p.full());
  r.budget = bounded.async_host_bytes();
  for (int i = 0; i < 3; ++i) r.sync.push_back(sync_round(p, bounded));  // the windows' unit
  const double unit = median(r.sync);
  for (int rep = 0; rep < p.o.repeat; ++rep) {
    progress(cat("round ", rep + 1, " of ", p.o.repeat, ": bounded async saves"));
    r.sync.push_back(sync_round(p, bounded));
    for (std::size_t w = 0; w < windows.size(); ++w) {
      const Timing t = async_round(p, bounded, windows[w] * unit);
      r.blocking[w].push_back(t.blocking);
      r.total[w].push_back(t.total);
    }
    const Timing t = async_round(p, full, 0);
    r.full_blocking.push_back(t.blocking);
    r.full_total.push_back(t.total);
  }
}

void report_phase(const Phase& p, const Results& r, std::int64_t bounded_peak, std::int64_t full_peak,
                  std::int64_t bad, Report& report) {
  const double sync = median(r.sync);
  report.set("async_bounded_device", p.o.device);
  report.add("async_bounded_sync_save_s", sync, cat("(one rank, ", p.rank_bytes, " bytes, Saver::save)"));
  for (std::size_t w = 0; w < windows.size(); ++w)
    report.add(cat("async_bounded_blocking_s_", window_names[w]), median(r.blocking[w]),
               cat("(save_async + wait_staged, window ", windows[w], " x sync)"));
  const double ratio = median(r.blocking[3]) / sync, total = median(r.total[0]) / sync;
  report.add("async_bounded_blocking_ratio_w2", ratio, "<= 0.05", ratio <= 0.05);
  report.add("async_bounded_total_ratio_w0", total, "<= 1.1", total <= 1.1);
  report.add("async_bounded_budget_bytes", static_cast<double>(r.budget), cat("< ", p.rank_bytes, " (the rank's bytes)"),
             r.budget < p.rank_bytes);
  const auto limit = static_cast<std::int64_t>(r.budget) + 16 * MiB;
  report.add("async_bounded_peak_host_bytes", static_cast<double>(bounded_peak), cat("<= ", limit, " (budget + 16 MiB)"),
             bounded_peak <= limit);
  report.add("async_full_blocking_s", median(r.full_blocking), "(today's full staging: save_async)");
  report.add("async_full_total_ratio", median(r.full_total) / sync, "(full staging, until wait() / sync)");
  report.add("async_full_staging_bytes", static_cast<double>(p.full().async_host_bytes), "(the rank's bytes, pinned)");
  report.add("async_full_peak_host_bytes", static_cast<double>(full_peak), "(full staging)");
  report.add("async_bounded_mismatches", static_cast<double>(bad));
  json seconds = {{"sync", r.sync}, {"full_blocking", r.full_blocking}, {"full_total", r.full_total}};
  for (std::size_t w = 0; w < windows.size(); ++w) {
    seconds[cat("blocking_", window_names[w])] = r.blocking[w];
    seconds[cat("total_", window_names[w])] = r.total[w];
  }
  report.set("async_bounded_seconds", seconds);
}

}  // namespace

void measure_async_bounded(const Options& o, const fs::path& dir, Cache& cache, PeakMeter& meter, Report& report) {
  Phase p{o, dir, dir / "bounded.h5", cache, meter, bench_config(o.shape, std::int64_t{o.size_mib} * MiB), {1, 1, 0, 1},
          nullptr, {}};
  if (o.device != "host") p.engine = make_engine(o.device, 0);
  p.model = demo::build_rank(p.config, p.layout, 0, {},
                             p.engine ? demo::ShardMemory{MemoryKind::device, p.engine} : demo::ShardMemory{});
  for (const SaveItem& i : prepare_save(p.model.state).items)
    if (i.writes) p.rank_bytes += i.data.bytes(), ++p.pieces;
  p.budget = static_cast<std::size_t>(o.async_budget_mib) * MiB;
  const auto progress = [&](const std::string& what) {
    if (!o.json_out) std::fprintf(stderr, "  %s\n", what.c_str());
  };
  Results r;
  rounds(p, r, progress);
  const std::int64_t bounded_peak = peak_of(p, p.bounded());
  const std::int64_t bad = o.verify ? mismatches_of(p) : 0;
  const std::int64_t full_peak = peak_of(p, p.full());
  remove_file(p.file);
  report_phase(p, r, bounded_peak, full_peak, bad, report);
}

}  // namespace bench
