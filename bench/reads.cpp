// Loads against plain reads of the checkpoint file: allocating loads at the saving layout and
// resharded, without checksum checks, and loads in place into a model's existing shards (against
// a read into one reused buffer, since neither faults in fresh memory).
#include <mutex>

#include "bench.hpp"

namespace bench {
namespace {

struct Reads {
  std::vector<double> raw, reused, load, unchecked, reshard, into, into_reshard, into_bypass;
  std::int64_t load_peak = 0, reshard_peak = 0, into_peak = 0, into_reshard_peak = 0, ignored_peak = 0;
  std::int64_t file_bytes = 0, values = 0, mismatches = 0;
  std::string first_mismatch;
  std::mutex mutex;

  void count(const demo::Verification& v) {
    const std::lock_guard lock(mutex);
    values += v.values;
    if (v.mismatches && !mismatches) first_mismatch = v.first_mismatch;
    mismatches += v.mismatches;
  }
};

// One cold-cache load of the checkpoint at `l` into memory it allocates; the pattern is checked
// (untimed) when `check`.
double load_round(Run& run, const demo::Layout& l, bool verify_checksums, bool check, std::int64_t& peak, Reads& r) {
  std::vector<StateDict> requests;
  for (int rank = 0; rank < l.ranks(); ++rank) requests.push_back(demo::request(run.config, l, rank));
  std::vector<std::optional<LoadedState>> loaded(requests.size());
  run.cache.cold();
  run.meter.begin();
  const double s = timed([&] {
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      const auto me = static_cast<std::size_t>(g.rank());
      loaded[me].emplace(load(run.ckpt, requests[me], g, {.verify_checksums = verify_checksums}));
    });
  });
  peak = std::max(peak, run.meter.end());
  if (check)
    parallel_for(l.ranks(), [&](int rank) {
      const auto me = static_cast<std::size_t>(rank);
      r.count(demo::verify(run.config, {}, rank, requests[me], *loaded[me]));
    });
  return s;
}

// One cold-cache load in place into `model` (one state dict per rank, shards already in memory).
double into_round(Run& run, const demo::Layout& l, std::vector<StateDict>& model, bool check, std::int64_t& peak,
                  Reads& r, bool bypass_page_cache = false) {
  std::vector<Values> values(model.size());
  run.cache.cold();
  run.meter.begin();
  const double s = timed([&] {
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      const auto me = static_cast<std::size_t>(g.rank());
      values[me] = load_into(run.ckpt, model[me], g, {.bypass_page_cache = bypass_page_cache});
    });
  });
  peak = std::max(peak, run.meter.end());
  if (check)
    parallel_for(l.ranks(), [&](int rank) {
      const auto me = static_cast<std::size_t>(rank);
      r.count(demo::verify(run.config, {}, rank, model[me], values[me]));
    });
  return s;
}

std::vector<StateDict> destinations(const Run& run, const demo::Layout& l) {
  std::vector<StateDict> out(static_cast<std::size_t>(l.ranks()));
  parallel_for(l.ranks(), [&](int rank) {
    out[static_cast<std::size_t>(rank)] = demo::with_destinations(demo::request(run.config, l, rank));
  });
  return out;
}

void read_round(Run& run, Reads& r, std::vector<StateDict>& same, std::vector<StateDict>& resharded,
                bool check) {
  run.cache.cold();
  r.raw.push_back(timed([&] { r.file_bytes = raw_read(run.ckpt); }));
  run.cache.cold();
  r.reused.push_back(timed([&] { (void)raw_read_reused(run.ckpt); }));
  r.load.push_back(load_round(run, run.sl(), true, check, r.load_peak, r));
  r.unchecked.push_back(load_round(run, run.sl(), false, false, r.ignored_peak, r));
  r.reshard.push_back(load_round(run, run.ll(), true, check, r.reshard_peak, r));
  r.into.push_back(into_round(run, run.sl(), same, check, r.into_peak, r));
  r.into_reshard.push_back(into_round(run, run.ll(), resharded, check, r.into_reshard_peak, r));
  r.into_bypass.push_back(into_round(run, run.sl(), same, false, r.ignored_peak, r, true));
}

std::int64_t shard_bytes(const Run& run, const demo::Layout& l) {
  std::int64_t n = 0;
  for (int rank = 0; rank < l.ranks(); ++rank) {
    const StateDict request = demo::request(run.config, l, rank);
    for (const ShardedParam& p : request.params())
      n += p.shard_shape().elements() * element_bytes(p.dtype);
  }
  return n;
}

void report_reads(Run& run, const Reads& r, Report& report) {
  const double gb = static_cast<double>(run.bytes) / 1e9, file_gb = static_cast<double>(r.file_bytes) / 1e9;
  const double raw = file_gb / median(r.raw), reused = file_gb / median(r.reused);
  run.raw_read_gbps = raw;
  const double load = gb / median(r.load), reshard = gb / median(r.reshard);
  report.add("raw_read_gbps", raw);
  report.add("raw_read_reused_buffer_gbps", reused, "(the baseline of loads in place)");
  report.add("load_gbps", load);
  report.add("load_ratio", load / raw, ">= 0.9", load / raw >= 0.9);
  const double checksum_cost = median(r.load) / median(r.unchecked) - 1;
  report.add("load_unchecked_gbps", gb / median(r.unchecked), "(load without checking checksums)");
  report.add("checksum_load_overhead", checksum_cost, "<= 0.05", checksum_cost <= 0.05);
  report.add("reshard_load_gbps", reshard);
  report.add("reshard_ratio", reshard / raw, ">= 0.8", reshard / raw >= 0.8);
  report.add("load_peak_extra_bytes", static_cast<double>(r.load_peak),
             cat("(shards loaded: ", shard_bytes(run, run.sl()), ")"));
  report.add("reshard_peak_extra_bytes", static_cast<double>(r.reshard_peak),
             cat("(shards loaded: ", shard_bytes(run, run.ll()), ")"));
  const double into = gb / median(r.into), into_reshard = gb / median(r.into_reshard);
  report.add("load_into_gbps", into);
  report.add("load_into_ratio", into / reused, ">= 0.9", into / reused >= 0.9);
  report.add("load_into_reshard_gbps", into_reshard);
  report.add("load_into_reshard_ratio", into_reshard / reused, ">= 0.9", into_reshard / reused >= 0.9);
  report.add("load_into_bypass_gbps", gb / median(r.into_bypass), "(bypass_page_cache: O_DIRECT)");
  const std::int64_t into_peak = std::max(r.into_peak, r.into_reshard_peak);
  report.add("load_into_peak_extra_bytes", static_cast<double>(into_peak),
             cat("<= ", run.peak_budget(), " (1% + 16 MiB)"), into_peak <= run.peak_budget());
  report.add("verified_values", static_cast<double>(r.values));
  report.add("mismatches", static_cast<double>(r.mismatches));
  if (r.mismatches) report.set("first_mismatch", r.first_mismatch);
  report.set("read_seconds", {{"raw_read", r.raw},
                              {"raw_read_reused_buffer", r.reused},
                              {"load", r.load},
                              {"load_unchecked", r.unchecked},
                              {"reshard_load", r.reshard},
                              {"load_into", r.into},
                              {"load_into_reshard", r.into_reshard},
                              {"load_into_bypass", r.into_bypass}});
}

}  // namespace

void measure_reads(Run& run, Report& report) {
  // A trainer's model: shards that exist (and whose pages were touched) before any load.
  std::vector<StateDict> same = destinations(run, run.sl()), resharded = destinations(run, run.ll());
  // The first read of a freshly written file can run at another speed than later ones (the disk of a
  // virtual machine has caches of its own below the page cache): one untimed read first.
  run.cache.cold();
  (void)raw_read(run.ckpt);
  Reads r;
  for (int rep = 0; rep < run.o.read_repeat; ++rep) {
    run.progress(cat("round ", rep + 1, " of ", run.o.read_repeat, ": reads"));
    read_round(run, r, same, resharded, run.o.verify && rep == 0);
  }
  report_reads(run, r, report);
}

}  // namespace bench
