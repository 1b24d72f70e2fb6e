// Saves against a plain write of the same bytes: with and without checksums, in the background
// (against a memcpy of the bytes), the old gather-then-split save, and h5py hyperslab writes.
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "bench.hpp"

namespace bench {
namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

// The offset and count of a box of a dataset whose dims past 1 are never split.
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> slab_of(const Box& box, const std::vector<std::int64_t>& shape) {
  const std::int64_t inner = element_count(std::span(shape).subspan(std::min<std::size_t>(2, shape.size())));
  std::vector<std::int64_t> offset(shape.size(), 0), count = shape;
  offset[0] = box.rows.begin;
  count[0] = box.rows.size();
  if (shape.size() > 1) {
    offset[1] = box.cols.begin / inner;
    count[1] = box.cols.size() / inner;
  }
  return {offset, count};
}

// Every written piece of every rank, and every dataset, for bench/h5py_compare.py.
json piece_plan(const std::vector<SavePlan>& plans) {
  json datasets = json::object(), pieces = json::array();
  for (std::size_t r = 0; r < plans.size(); ++r)
    for (const SaveItem& i : plans[r].items) {
      if (!i.writes) continue;
      datasets[i.key] = {{"shape", i.global_shape}, {"dtype", dtype_name(i.dtype)}};
      const auto [offset, count] = slab_of(i.box, i.global_shape);
      pieces.push_back({{"key", i.key}, {"offset", offset}, {"count", count}, {"dtype", dtype_name(i.dtype)}, {"rank", r}});
    }
  json ds = json::array();
  for (auto& [key, d] : datasets.items()) ds.push_back({{"key", key}, {"shape", d["shape"]}, {"dtype", d["dtype"]}});
  return {{"datasets", ds}, {"pieces", pieces}};
}

struct Writes {
  std::vector<double> raw, save, unchecked, gather, h5py, async_blocking, async_total, memcpy;
  std::int64_t raw_peak = 0, save_peak = 0, gather_peak = 0, gather_rank_peak = 0;
  std::string h5py_error, h5py_version;
  std::size_t staging_bytes = 0;
};

// `fn` from a cold cache, its file of the last round deleted first; its seconds, and its peak memory
// into `peak`.
double cold_timed(Run& run, const fs::path& file, std::int64_t& peak, const std::function<void()>& fn) {
  remove_file(file);
  run.cache.cold();
  run.meter.begin();
  const double s = timed(fn);
  peak = std::max(peak, run.meter.end());
  return s;
}

void save_all(Run& run, const fs::path& file, bool checksums) {
  run_ranks(run.sl().ranks(), [&](ProcessGroup& g) {
    save(run.models[static_cast<std::size_t>(g.rank())].state, file, g, {.checksums = checksums});
  });
}

// Rank 0's seconds from a barrier to a barrier around fn(rank) on every rank.
double between_barriers(int ranks, const std::function<void(ProcessGroup&)>& fn) {
  double seconds = 0;
  run_ranks(ranks, [&](ProcessGroup& g) {
    g.barrier();
    const auto t0 = Clock::now();
    fn(g);
    g.barrier();
    if (g.rank() == 0) seconds = seconds_since(t0);
  });
  return seconds;
}

// One async save on every rank: how long the callers were blocked, and how long until every wait
// returned. The savers live across rounds, as a trainer's would.
void async_round(Run& run, std::vector<std::unique_ptr<Saver>>& savers, const fs::path& file, Writes& w) {
  remove_file(file);
  run.cache.cold();
  std::vector<std::optional<AsyncSave>> pending(savers.size());
  const auto t0 = Clock::now();
  w.async_blocking.push_back(between_barriers(run.sl().ranks(), [&](ProcessGroup& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    pending[r] = savers[r]->save_async(run.models[r].state, file);
  }));
  for (auto& p : pending) p->wait();
  w.async_total.push_back(seconds_since(t0));
}

// The baseline of the async save's blocking time: every rank copies the bytes it writes into memory
// of its own that it reuses (as the saver's staging is reused).
double memcpy_round(Run& run, std::vector<HostBuffer>& into) {
  return between_barriers(run.sl().ranks(), [&](ProcessGroup& g) {
    const auto r = static_cast<std::size_t>(g.rank());
    std::byte* at = into[r].mut_view().data();
    for (const SaveItem& i : run.plans[r].items)
      if (i.writes && !i.data.empty()) std::memcpy(at, i.data.data(), i.data.bytes()), at += i.data.bytes();
  });
}

std::vector<HostBuffer> memcpy_targets(const Run& run) {
  std::vector<HostBuffer> out;
  for (const SavePlan& p : run.plans) {
    std::int64_t n = 0;
    for (const SaveItem& i : p.items)
      if (i.writes) n += static_cast<std::int64_t>(i.data.bytes());
    out.push_back(HostBuffer::zeros(DType::u8, {n}));  // touched: reused memory
  }
  return out;
}

void write_round(Run& run, Writes& w, std::vector<std::unique_ptr<Saver>>& savers, std::vector<HostBuffer>& copies,
                 bool h5py) {
  const fs::path raw = run.dir / "raw.bin", unchecked = run.dir / "unchecked.h5", gather = run.dir / "gather.h5",
                 async = run.dir / "async.h5", h5 = run.dir / "h5py.h5";
  w.raw.push_back(cold_timed(run, raw, w.raw_peak, [&] { raw_write(raw, run.plans); }));
  w.save.push_back(cold_timed(run, run.ckpt, w.save_peak, [&] { save_all(run, run.ckpt, true); }));
  std::int64_t ignored = 0;
  w.unchecked.push_back(cold_timed(run, unchecked, ignored, [&] { save_all(run, unchecked, false); }));
  w.gather.push_back(cold_timed(run, gather, w.gather_peak, [&] {
    w.gather_rank_peak = demo::gather_save(run.config, run.sl(), run.models, gather);
  }));
  if (h5py) {
    remove_file(h5);
    run.cache.cold();
    if (const auto s = h5py_write(run, h5, w.h5py_error, w.h5py_version)) w.h5py.push_back(*s);
  }
  async_round(run, savers, async, w);
  w.memcpy.push_back(memcpy_round(run, copies));
  if (!run.o.keep)
    for (const fs::path& p : {raw, unchecked, gather, async, h5}) remove_file(p);
}

void report_writes(Run& run, const Writes& w, Report& report) {
  const double gb = static_cast<double>(run.bytes) / 1e9;
  const double raw = gb / median(w.raw), save = gb / median(w.save);
  run.raw_write_gbps = raw;
  report.add("raw_write_gbps", raw);
  report.add("save_gbps", save);
  report.add("save_ratio", save / raw, ">= 0.9", save / raw >= 0.9);
  const double checksum_cost = median(w.save) / median(w.unchecked) - 1;
  report.add("save_unchecked_gbps", gb / median(w.unchecked), "(save without checksums)");
  report.add("checksum_save_overhead", checksum_cost, "<= 0.05", checksum_cost <= 0.05);
  report.add("gather_save_gbps", gb / median(w.gather));
  if (!w.h5py.empty()) report.add("h5py_write_gbps", gb / median(w.h5py), w.h5py_version);
  if (!w.h5py_error.empty()) report.set("h5py_error", w.h5py_error);
  report.add("save_peak_extra_bytes", static_cast<double>(w.save_peak), cat("<= ", run.peak_budget(), " (1% + 16 MiB)"),
             w.save_peak <= run.peak_budget());
  report.add("gather_peak_extra_bytes", static_cast<double>(w.gather_peak), "(ranks gather in turn here)");
  report.add("gather_peak_per_rank_bytes", static_cast<double>(w.gather_rank_peak),
             cat("(x ", run.sl().ranks(), " ranks at once: ", w.gather_rank_peak * run.sl().ranks(), ")"));
  report.add("raw_write_peak_extra_bytes", static_cast<double>(w.raw_peak));
  const double blocking = median(w.async_blocking), ratio = blocking / median(w.memcpy);
  report.add("async_blocking_s", blocking, "(the callers wait for their bytes to be staged)");
  report.add("memcpy_s", median(w.memcpy), "(every rank copies its bytes into reused memory)");
  report.add("async_blocking_ratio", ratio, "<= 1.5", ratio <= 1.5);
  // The first async save of each saver against the later ones: the budget is allocated and faulted
  // in when the saver is made, so the first one should not wait for memory.
  if (w.async_blocking.size() >= 2) {
    const double first = w.async_blocking.front();
    const double later = median(std::vector<double>(w.async_blocking.begin() + 1, w.async_blocking.end()));
    report.add("async_first_blocking_s", first, "(the savers' first save_async)");
    report.add("async_later_blocking_s", later, "(median of the later ones)");
    report.add("async_first_blocking_ratio", first / later, "<= 2 (first / later)", first <= 2 * later);
  }
  report.add("async_total_ratio", median(w.async_total) / median(w.save), "(until wait() returns / save)");
  report.add("async_staging_bytes", static_cast<double>(w.staging_bytes), "(pinned, allocated once)");
  report.set("write_seconds", {{"raw_write", w.raw}, {"save", w.save}, {"save_unchecked", w.unchecked},
                               {"gather_save", w.gather}, {"h5py_write", w.h5py}, {"async_blocking", w.async_blocking},
                               {"async_total", w.async_total}, {"memcpy", w.memcpy}});
}

}  // namespace

bool python_has_h5py(const std::string& python) {
  if (!fs::exists(python)) return false;
  return std::system((python + " -c 'import h5py, numpy' >/dev/null 2>&1").c_str()) == 0;
}

std::optional<double> h5py_write(const Run& run, const fs::path& out, std::string& error, std::string& version) {
  const fs::path plan = run.dir / "pieces.json", result = out.string() + ".result.json";
  if (!fs::exists(plan)) std::ofstream(plan) << piece_plan(run.plans).dump();
  const std::string cmd = cat(run.o.python, " ", shell_quote(run.o.script), " ", shell_quote(plan.string()), " ",
                              shell_quote(out.string()), " > ", shell_quote(result.string()), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::stringstream text;
  text << std::ifstream(result).rdbuf();
  remove_file(result);
  try {
    const std::string s = text.str();
    const json r = json::parse(s.substr(s.rfind('{')));
    if (rc != 0) throw std::runtime_error("exit status");
    if (r.at("bytes").get<std::int64_t>() != run.bytes) error = cat("h5py wrote ", r.at("bytes"), " bytes, not ", run.bytes);
    version = r.value("h5py", "");
    return r.at("seconds").get<double>();
  } catch (const std::exception&) {
    error = cat("the h5py script failed (", rc, "): ", text.str());
    return std::nullopt;
  }
}

void measure_writes(Run& run, Report& report) {
  const bool h5py = run.o.h5py.value_or(python_has_h5py(run.o.python));
  // Savers whose budget holds their rank's bytes (each piece rounded to 64): async saves staged
  // whole, as before budgets (bounded.cpp measures the bounded ones).
  std::vector<std::unique_ptr<Saver>> savers(run.models.size());
  run_ranks(run.sl().ranks(), [&](ProcessGroup& g) {
    const auto me = static_cast<std::size_t>(g.rank());
    std::size_t whole = 0;
    for (const SaveItem& i : run.plans[me].items)
      if (i.writes) whole += i.data.bytes() + 64;
    savers[me] = std::make_unique<Saver>(g, SaverOptions{.async_host_bytes = whole});
  });
  std::vector<HostBuffer> copies = memcpy_targets(run);
  Writes w;
  for (int rep = 0; rep < run.o.repeat; ++rep) {
    run.progress(cat("round ", rep + 1, " of ", run.o.repeat, ": writes"));
    write_round(run, w, savers, copies, h5py);
  }
  for (const auto& s : savers) w.staging_bytes += s->staging_bytes();
  remove_file(run.dir / "pieces.json");
  report_writes(run, w, report);
}

}  // namespace bench
