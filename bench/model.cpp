// The bench model, its shards on every rank, the run's context and the report of shardckpt-bench.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "bench.hpp"

namespace bench {
namespace {

std::string number_text(double v) {
  char b[64];
  if (v == static_cast<double>(static_cast<std::int64_t>(v)) && std::abs(v) >= 1000)
    std::snprintf(b, sizeof b, "%lld", static_cast<long long>(v));
  else
    std::snprintf(b, sizeof b, "%.3f", v);
  return b;
}

}  // namespace

demo::ModelConfig bench_config(demo::ModelConfig c, std::int64_t target) {
  auto with_layers = [&](int layers) {
    c.gdp_layers = layers - layers / 4;
    c.mamba_layers = layers / 4;
    return demo::model_bytes(c);
  };
  // Where even two layers are too many, the hidden size shrinks instead.
  while (c.cols > 256 && with_layers(2) > target) c.cols /= 2;
  int best = 1;
  std::int64_t best_gap = INT64_MAX;
  for (int layers = 1; layers < 100000; ++layers) {
    const std::int64_t b = with_layers(layers);
    if (std::abs(b - target) < best_gap) best_gap = std::abs(b - target), best = layers;
    if (b > target) break;
  }
  with_layers(best);
  return c;
}

std::vector<demo::RankModel> build_models(const demo::ModelConfig& c, const demo::Layout& l,
                                          const std::function<demo::ShardMemory(int)>& placement) {
  std::vector<demo::RankModel> models(static_cast<std::size_t>(l.ranks()));
  parallel_for(l.ranks(), [&](int r) {
    models[static_cast<std::size_t>(r)] = demo::build_rank(c, l, r, {}, placement ? placement(r) : demo::ShardMemory{});
  });
  return models;
}

void Report::add(const std::string& name, double value, const std::string& note) {
  rows_.push_back({name, value, "", note, std::nullopt});
}

void Report::add(const std::string& name, double value, const std::string& target, bool met) {
  rows_.push_back({name, value, target, "", met});
}

void Report::set(const std::string& key, json value) { extra_[key] = std::move(value); }

bool Report::targets_met() const {
  return std::all_of(rows_.begin(), rows_.end(), [](const Row& r) { return r.met.value_or(true); });
}

json Report::to_json() const {
  json out = extra_;
  json targets = json::object();
  for (const Row& r : rows_) {
    out[r.name] = r.value;
    if (r.met) targets[r.name] = {{"target", r.target}, {"met", *r.met}};
  }
  out["targets"] = targets;
  out["targets_met"] = targets_met();
  return out;
}

void Report::print_table() const {
  std::printf("  %-36s %16s   %-30s %s\n", "figure", "value", "target", "met");
  for (const Row& r : rows_)
    std::printf("  %-36s %16s   %-30s %s\n", r.name.c_str(), number_text(r.value).c_str(),
                (r.met ? r.target : r.note).c_str(), r.met ? (*r.met ? "yes" : "NO") : "");
}

Run::Run(const Options& options, fs::path directory)
    : o(options), dir(std::move(directory)), cache(dir), ckpt(dir / "shardckpt.h5") {
  config = bench_config(o.shape, std::int64_t{o.size_mib} * MiB);
  progress(cat("building ", config.gdp_layers, " GDP + ", config.mamba_layers, " Mamba layers at ",
               demo::layout_text(sl())));
  models = build_models(config, sl());
  for (const auto& m : models) plans.push_back(prepare_save(m.state));
  bytes = demo::model_bytes(config);
}

void Run::progress(const std::string& what) const {
  if (!o.json_out) std::fprintf(stderr, "  %s\n", what.c_str());
}

// What was measured on: the model, its pieces, the layouts, the machine's methods.
void describe_model(const Run& run, Report& report) {
  std::int64_t pieces = 0, written = 0, row_parallel_pieces = 0, row_parallel_bytes = 0, shard_bytes = 0, pad_rows = 0;
  for (const SavePlan& p : run.plans)
    for (const SaveItem& i : p.items) {
      if (!i.writes || i.data.empty()) continue;
      ++pieces;
      written += static_cast<std::int64_t>(i.data.bytes());
      // Row-parallel weights (TP on dim 1) are stored chunked by TP band: one contiguous write each.
      if (i.box.cols.size() < whole_box(i.global_shape).cols.size()) {
        ++row_parallel_pieces;
        row_parallel_bytes += static_cast<std::int64_t>(i.data.bytes());
      }
    }
  for (const auto& m : run.models) shard_bytes += m.shard_bytes, pad_rows += m.pad_rows;
  require(written == run.bytes, Errc::internal, "the pieces hold ", written, " bytes, the model ", run.bytes);
  const demo::ModelConfig& c = run.config;
  report.set("bytes", run.bytes);
  report.set("pieces", pieces);
  report.set("shard_bytes", shard_bytes);
  report.set("pad_rows_not_written", pad_rows);
  report.set("row_parallel_pieces", row_parallel_pieces);
  report.set("row_parallel_bytes", row_parallel_bytes);
  report.set("save_layout", demo::layout_json(run.sl()));
  report.set("reshard_layout", demo::layout_json(run.ll()));
  report.set("model", {{"gdp_layers", c.gdp_layers}, {"mamba_layers", c.mamba_layers}, {"heads", c.dims.heads},
                       {"head_dim", c.dims.head_dim}, {"groups", c.dims.groups}, {"state", c.dims.state},
                       {"householder", c.dims.householder}, {"cols", c.cols}, {"dtype", dtype_name(c.dtype)},
                       {"tensors", demo::params(c, 1).size()}});
  report.set("repeat", run.o.repeat);
  report.set("read_repeat", run.o.read_repeat);
  report.set("directory", run.dir.string());
  report.set("cache", run.cache.method());
  report.set("peak_memory_method", run.meter.method());
  report.set("allocator", "glibc malloc, M_MMAP_THRESHOLD fixed at 1 MiB");
}

}  // namespace bench
