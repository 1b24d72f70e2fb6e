// The seed's geometry with narrow rows: the fused in_proj (61,760 TP-local rows, 15 blocks) and
// conv1d (9 blocks) of 72 GDP layers at TP 8 x GTP 64 (alignment 32), 2 columns, saved by 512 thread
// ranks and loaded back by them. Every rank holds 144 small shards of many blocks: what the library
// keeps per rank and per dataset (HDF5 caches, slab tables, plans) shows here, next to shards of
// only 392 MB. The row-parallel out_proj is left out: at 2 columns it has 2 rows, padded to 2,048 per
// TP rank, which is 18.8 GB of pad rows (the alignment's cost, not the library's).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "bench.hpp"

namespace bench {
namespace {

std::vector<ParamSpec> seed_specs(const SeedGeometry& g) {
  std::vector<ParamSpec> out;
  for (int layer = 0; layer < g.layers; ++layer) {
    const std::string prefix = cat("decoder.layers.", layer, ".mixer.");
    out.push_back({prefix + "in_proj.weight", gdp_in_proj_sections(g.dims, g.tp), {2}, TpAxis::rows, g.tp,
                   ssm_divisors(g.dims)});
    out.push_back({prefix + "conv1d.weight", gdp_conv1d_sections(g.dims, g.tp), {1, 4}, TpAxis::rows, g.tp,
                   ssm_divisors(g.dims)});
  }
  return out;
}

ShardedParam param_of(const SeedGeometry& g, const ParamSpec& spec, int rank) {
  return {spec, g.gtp, g.align, {rank / g.gtp, rank % g.gtp}, DType::bf16};
}

// A shard's byte i is (rank + parameter + i) mod 251 in its real rows: what the load checks.
std::byte value_at(int rank, std::size_t param, std::size_t i) {
  return static_cast<std::byte>((static_cast<std::size_t>(rank) + param + i) % 251);
}

std::size_t real_bytes(const SeedGeometry& g, const ParamSpec& spec, int rank, TensorView shard) {
  const ShardedParam p = param_of(g, spec, rank);
  return static_cast<std::size_t>(plan_rank(p.spec, p.gtp, p.align, p.coord).real_rows) * shard.row_bytes();
}

// What a phase run in a process of its own reports: its resident memory at its highest (VmHWM: the
// whole process, from its start), its seconds, and a count (bytes, mismatches).
struct Outcome {
  std::int64_t peak_rss = 0;
  double seconds = 0;
  std::int64_t count = 0;
};

// Runs phase `name` in a fresh process: this program exec'd with --seed-phase, so that its peak is
// its own, not the memory of the process that started it (a forked child shares its parent's
// resident pages, and VmHWM counts them) nor what an earlier phase left in the allocator.
Outcome in_fresh_process(const std::string& name, const fs::path& dir) {
  int fds[2];
  if (::pipe(fds) != 0) die("pipe");
  const pid_t pid = ::fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl("/proc/self/exe", "shardckpt-bench", "--seed-phase", name.c_str(), "--dir", dir.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[256];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) text.append(buffer, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome out;
  const bool parsed = std::sscanf(text.c_str(), "%lld %lf %lld", reinterpret_cast<long long*>(&out.peak_rss),
                                  &out.seconds, reinterpret_cast<long long*>(&out.count)) == 3;
  require(parsed && WIFEXITED(status) && WEXITSTATUS(status) == 0, Errc::internal, "the seed-geometry ", name,
          " phase failed in its process");
  return out;
}

std::int64_t save_phase(const SeedGeometry& g, const std::vector<ParamSpec>& specs, const fs::path& path) {
  std::atomic<std::int64_t> bytes{0};
  run_ranks(g.ranks(), [&](ProcessGroup& group) {
    StateDict state;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      ShardedParam p = param_of(g, specs[i], group.rank());
      SharedBuffer shard = SharedBuffer::zeros(p.dtype, p.shard_shape());
      std::byte* out = shard.mut_view().data();
      const std::size_t real = real_bytes(g, specs[i], group.rank(), shard.view());
      for (std::size_t b = 0; b < real; ++b) out[b] = value_at(group.rank(), i, b);
      bytes += static_cast<std::int64_t>(shard.bytes());
      p.shard = shard;
      state.add(std::move(p));
    }
    save(state, path, group);
  });
  return bytes.load();
}

std::int64_t load_phase(const SeedGeometry& g, const std::vector<ParamSpec>& specs, const fs::path& path) {
  std::atomic<std::int64_t> mismatches{0};
  run_ranks(g.ranks(), [&](ProcessGroup& group) {
    StateDict request;
    for (const ParamSpec& spec : specs) request.add(param_of(g, spec, group.rank()));
    const LoadedState state = load(path, request, group);
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const TensorView shard = state.tensor(specs[i].key).view();
      const std::size_t real = real_bytes(g, specs[i], group.rank(), shard);
      for (std::size_t b = 0; b < shard.bytes(); ++b)
        if (shard.data()[b] != (b < real ? value_at(group.rank(), i, b) : std::byte{0})) {
          ++mismatches;
          break;
        }
    }
  });
  return mismatches.load();
}

}  // namespace

int run_seed_phase(const std::string& name, const fs::path& dir) {
  const SeedGeometry g{.cols = 2};
  const std::vector<ParamSpec> specs = seed_specs(g);
  const fs::path path = dir / "seed-geometry.h5";
  try {
    Outcome out;
    out.seconds = timed([&] { out.count = name == "save" ? save_phase(g, specs, path) : load_phase(g, specs, path); });
    out.peak_rss = proc_status_bytes("VmHWM:");
    std::printf("%lld %.9f %lld\n", static_cast<long long>(out.peak_rss), out.seconds, static_cast<long long>(out.count));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardckpt-bench: seed geometry (%s): %s\n", name.c_str(), e.what());
    return 1;
  }
}

void measure_seed_geometry(const fs::path& dir, Report& report) {
  const SeedGeometry g{.cols = 2};
  const std::vector<ParamSpec> specs = seed_specs(g);
  const fs::path path = dir / "seed-geometry.h5";
  const Outcome saved = in_fresh_process("save", dir);
  const Outcome loaded = in_fresh_process("load", dir);
  const std::int64_t peak = std::max(saved.peak_rss, loaded.peak_rss);
  const std::int64_t file_bytes = static_cast<std::int64_t>(fs::file_size(path));
  remove_file(path);
  report.add("seed_geometry_peak_rss_bytes", static_cast<double>(peak), "< 2 GiB", peak < 2 * 1024 * MiB);
  report.add("seed_geometry_save_seconds", saved.seconds,
             cat("(", g.layers, " layers x 2 fused weights, 2 columns, TP ", g.tp, " x GTP ", g.gtp, ", A ", g.align,
                 ": ", g.ranks(), " thread ranks)"));
  report.add("seed_geometry_load_seconds", loaded.seconds, "(the same layout, every byte checked)");
  report.set("seed_geometry_save_peak_rss_bytes", saved.peak_rss);
  report.set("seed_geometry_load_peak_rss_bytes", loaded.peak_rss);
  report.set("seed_geometry_shard_bytes", saved.count);
  report.set("seed_geometry_file_bytes", file_bytes);
  report.set("seed_geometry_datasets", specs.size() / 2 * (3 * g.dims.householder + 3 + 2 * g.dims.householder + 1));
  report.set("seed_geometry_mismatches", loaded.count);
}

}  // namespace bench
