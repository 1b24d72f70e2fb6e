// Shards in device memory (--device emulated or cuda), moved only by a copy engine: saves stream
// device -> pinned -> file through each rank's pool, loads file -> pinned -> device. Compared with
// the slower of the engine's peak copy rate and the plain write (or read) of the same bytes; and a
// save must leave the device's free memory as it found it.
#include <algorithm>

#include "bench.hpp"
#ifdef SHARDCKPT_HAVE_CUDA
import shardckpt.cuda;
#endif

namespace bench {

std::shared_ptr<CopyEngine> make_engine(const std::string& device, int rank) {
  if (device == "emulated") return std::make_shared<EmulatedDevice>(0);
#ifdef SHARDCKPT_HAVE_CUDA
  if (CudaEngine::devices() > 0) return std::make_shared<CudaEngine>(rank % CudaEngine::devices());
  throw Error(Errc::device, "--device cuda: no CUDA device is available");
#else
  (void)rank;
  throw Error(Errc::device, "--device cuda: this build has no CUDA support");
#endif
}

namespace {

// The engine's copy rate between device memory and pinned memory, one copy of `bytes` (median of 3).
std::pair<double, double> peak_copy_gbps(CopyEngine& engine, std::int64_t bytes) {
  SharedBuffer device = engine.allocate_device(DType::u8, {bytes});
  SharedBuffer pinned = engine.allocate_pinned(DType::u8, {bytes});
  std::vector<double> d2h, h2d;
  for (int i = 0; i < 4; ++i) {  // the first round warms up
    h2d.push_back(timed([&] {
      engine.copy_to_device(pinned.view(), device.mut_view());
      engine.wait(engine.fence());
    }));
    d2h.push_back(timed([&] {
      engine.copy_to_host(device.view(), pinned.mut_view());
      engine.wait(engine.fence());
    }));
  }
  d2h.erase(d2h.begin()), h2d.erase(h2d.begin());
  const double gb = static_cast<double>(bytes) / 1e9;
  return {gb / median(d2h), gb / median(h2d)};
}

struct Ranks {
  std::vector<std::shared_ptr<CopyEngine>> engines;
  std::vector<demo::RankModel> models;
  std::vector<std::unique_ptr<Saver>> savers;
  std::vector<std::shared_ptr<StagingPool>> pools;
  std::vector<StateDict> destinations;
};

Ranks device_ranks(Run& run) {
  Ranks d;
  const int n = run.sl().ranks();
  for (int r = 0; r < n; ++r) d.engines.push_back(make_engine(run.o.device, r));
  d.models = build_models(run.config, run.sl(), [&](int r) {
    return demo::ShardMemory{MemoryKind::device, d.engines[static_cast<std::size_t>(r)]};
  });
  d.savers.resize(static_cast<std::size_t>(n));
  run_ranks(n, [&](ProcessGroup& g) {
    const auto me = static_cast<std::size_t>(g.rank());
    d.savers[me] = std::make_unique<Saver>(g, SaverOptions{.engine = d.engines[me]});
  });
  for (int r = 0; r < n; ++r) {
    const std::shared_ptr<CopyEngine>& engine = d.engines[static_cast<std::size_t>(r)];
    d.pools.push_back(std::make_shared<StagingPool>(engine));
    d.destinations.push_back(demo::with_destinations(demo::request(run.config, run.sl(), r), {MemoryKind::device, engine}));
  }
  return d;
}

double save_round(Run& run, Ranks& d) {
  remove_file(run.ckpt);
  run.cache.cold();
  return timed([&] {
    run_ranks(run.sl().ranks(), [&](ProcessGroup& g) {
      const auto me = static_cast<std::size_t>(g.rank());
      d.savers[me]->save(d.models[me].state, run.ckpt);
    });
  });
}

double load_round(Run& run, Ranks& d, bool check, std::int64_t& mismatches) {
  std::vector<Values> values(d.destinations.size());
  run.cache.cold();
  const double s = timed([&] {
    run_ranks(run.sl().ranks(), [&](ProcessGroup& g) {
      const auto me = static_cast<std::size_t>(g.rank());
      values[me] = load_into(run.ckpt, d.destinations[me], g, {.staging = d.pools[me]});
    });
  });
  if (check)
    for (std::size_t r = 0; r < values.size(); ++r)
      mismatches += demo::verify(run.config, {}, static_cast<int>(r), d.destinations[r], values[r], d.engines[r].get())
                        .mismatches;
  return s;
}

// Free device memory before and after ten saves: the most any engine's device lost.
std::int64_t growth_over_ten_saves(Run& run, Ranks& d) {
  std::vector<std::size_t> before;
  for (const auto& e : d.engines) before.push_back(e->free_device_memory());
  for (int i = 0; i < 10; ++i) (void)save_round(run, d);
  std::int64_t growth = 0;
  for (std::size_t r = 0; r < d.engines.size(); ++r)
    growth = std::max(growth, static_cast<std::int64_t>(before[r]) -
                                  static_cast<std::int64_t>(d.engines[r]->free_device_memory()));
  return growth;
}

}  // namespace

void check_device(const std::string& device) {
  if (device != "host") (void)make_engine(device, 0);
}

void measure_device(Run& run, Report& report) {
  if (run.o.device == "host") return;
  run.progress(cat("shards in ", run.o.device, " device memory"));
  const auto [d2h, h2d] = peak_copy_gbps(*make_engine(run.o.device, 0), std::min<std::int64_t>(run.bytes, 1024 * MiB));
  Ranks d = device_ranks(run);
  std::vector<double> saves, loads;
  std::int64_t mismatches = 0;
  for (int rep = 0; rep < run.o.repeat; ++rep) {
    run.progress(cat("round ", rep + 1, " of ", run.o.repeat, ": device saves and loads"));
    saves.push_back(save_round(run, d));
    loads.push_back(load_round(run, d, run.o.verify && rep == 0, mismatches));
  }
  const std::int64_t growth = growth_over_ten_saves(run, d);
  const double gb = static_cast<double>(run.bytes) / 1e9, save = gb / median(saves), load = gb / median(loads);
  const double save_ratio = save / std::min(d2h, run.raw_write_gbps), load_ratio = load / std::min(h2d, run.raw_read_gbps);
  report.set("device", run.o.device);
  report.add("d2h_peak_gbps", d2h, "(device -> pinned, one copy)");
  report.add("h2d_peak_gbps", h2d, "(pinned -> device, one copy)");
  report.add("device_save_gbps", save);
  report.add("device_save_ratio", save_ratio, ">= 0.8 (of min(d2h, raw write))", save_ratio >= 0.8);
  report.add("device_load_gbps", load);
  report.add("device_load_ratio", load_ratio, ">= 0.8 (of min(h2d, raw read))", load_ratio >= 0.8);
  report.add("reserved_growth_bytes_over_10_saves", static_cast<double>(growth), "== 0", growth == 0);
  report.add("device_mismatches", static_cast<double>(mismatches));
  report.set("device_seconds", {{"save", saves}, {"load", loads}});
}

}  // namespace bench
