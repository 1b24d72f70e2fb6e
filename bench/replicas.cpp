// Data-parallel copies: every copy of a shard writes a balanced share of it (write_balance: the most
// bytes one rank wrote over the mean), and a load reads each byte once per group of copies, which
// hand each other the rows (read_amplification: bytes read from storage over the bytes the job
// needs, against every copy reading everything).
#include <algorithm>
#include <numeric>

#include "bench.hpp"

import shardckpt.storage;

namespace bench {
namespace {

// Bytes read from storage by a cold-cache load in place of `file` at `l` on every rank; with
// `share`, the copies of each shard read a share each and exchange the rest.
std::int64_t bytes_read_by_load(Run& run, const demo::ModelConfig& c, const demo::Layout& l, const fs::path& file,
                                bool share, std::int64_t& mismatches) {
  std::vector<StateDict> model(static_cast<std::size_t>(l.ranks()));
  parallel_for(l.ranks(), [&](int r) { model[static_cast<std::size_t>(r)] = demo::with_destinations(demo::request(c, l, r)); });
  std::vector<Values> values(model.size());
  run.cache.cold();
  const io::IoStats before = io::io_stats();
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const demo::RankCoord at = demo::coord_of(l, g.rank());
    const std::unique_ptr<ProcessGroup> replicas = g.split(at.tp * l.gtp + at.gtp, at.dp);
    const auto me = static_cast<std::size_t>(g.rank());
    values[me] = load_into(file, model[me], g, {}, share ? Replicas(*replicas) : Replicas());
  });
  const io::IoStats after = io::io_stats();
  std::vector<std::int64_t> bad(model.size());
  parallel_for(l.ranks(), [&](int r) {
    const auto me = static_cast<std::size_t>(r);
    bad[me] = demo::verify(c, {}, r, model[me], values[me]).mismatches;
  });
  mismatches += std::accumulate(bad.begin(), bad.end(), std::int64_t{0});
  return static_cast<std::int64_t>(after.bytes_read - before.bytes_read);
}

// The bytes each rank wrote in a cold-cache save of `models` at `l`.
std::vector<std::int64_t> bytes_written_by_save(Run& run, const demo::Layout& l, std::vector<demo::RankModel>& models,
                                                const fs::path& file) {
  std::vector<std::int64_t> written(models.size(), 0);
  remove_file(file);
  run.cache.cold();
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const auto me = static_cast<std::size_t>(g.rank());
    // Told on the rank that wrote them, on its own thread.
    save(models[me].state, file, g, {.progress = [&written, me](std::int64_t n) { written[me] += n; }});
  });
  return written;
}

}  // namespace

void measure_replicas(Run& run, Report& report) {
  if (run.o.dp <= 1) return;
  // As many bytes of shards as the main phases hold: the model is 1/DP of their size.
  const demo::ModelConfig c = bench_config(run.o.shape, std::int64_t{run.o.size_mib} * MiB / run.o.dp);
  const demo::Layout l{run.sl().tp, run.sl().gtp, run.sl().align, run.o.dp};
  run.progress(cat("data-parallel copies: ", demo::layout_text(l)));
  std::vector<demo::RankModel> models = build_models(c, l);
  const fs::path file = run.dir / "replicas.h5";
  const std::vector<std::int64_t> written = bytes_written_by_save(run, l, models, file);
  models.clear();
  const double mean = static_cast<double>(std::accumulate(written.begin(), written.end(), std::int64_t{0})) /
                      static_cast<double>(written.size());
  const double balance = static_cast<double>(*std::max_element(written.begin(), written.end())) / mean;
  std::int64_t mismatches = 0;
  const auto needed = static_cast<double>(demo::model_bytes(c));
  const double shared = static_cast<double>(bytes_read_by_load(run, c, l, file, true, mismatches)) / needed;
  const double unshared = static_cast<double>(bytes_read_by_load(run, c, l, file, false, mismatches)) / needed;
  if (!run.o.keep) remove_file(file);
  report.add("write_balance", balance, "<= 1.1", balance <= 1.1);
  report.add("read_amplification", shared, "<= 1.05", shared <= 1.05);
  report.add("read_amplification_unshared", unshared, "(every copy reads everything)");
  report.add("replica_mismatches", static_cast<double>(mismatches));
  report.set("replica_layout", demo::layout_json(l));
  report.set("replica_bytes", demo::model_bytes(c));
}

}  // namespace bench
