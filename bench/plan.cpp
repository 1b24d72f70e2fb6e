// Planning at the seed's scale: 72 GDP layers, TP 8 x GTP 64 (512 ranks), alignment 32, TP-local
// in_proj of 61,760 x 10,240 bf16. Plans only, no data.
#include <malloc.h>
#include <sys/mman.h>

#include <algorithm>

#include "bench.hpp"

namespace bench {
namespace {

// H = 4 Householder steps: (H + 1) * (dI + gS + nH) = 5 * (8192 + 4096 + 64) = 61,760 TP-local rows.
using Seed = SeedGeometry;

// plan_rank of the 72 in_proj weights on every rank (best of 5 passes): microseconds per rank, and
// pieces per rank.
std::pair<double, double> plan_in_proj(const Seed& f, std::vector<ParamSpec>& specs) {
  for (int layer = 0; layer < f.layers; ++layer)
    specs.push_back({cat("decoder.layers.", layer, ".mixer.in_proj.weight"), gdp_in_proj_sections(f.dims, f.tp),
                     {f.cols}, TpAxis::rows, f.tp, ssm_divisors(f.dims)});
  require(specs[0].rows() == 61760, Errc::layout, "the seed dims give ", specs[0].rows(), " TP-local rows, not 61,760");
  double best = 1e30;
  std::size_t pieces = 0;
  for (int rep = 0; rep < 5; ++rep) {
    pieces = 0;
    best = std::min(best, timed([&] {
                      for (int t = 0; t < f.tp; ++t)
                        for (int g = 0; g < f.gtp; ++g)
                          for (const ParamSpec& spec : specs) pieces += plan_rank(spec, f.gtp, f.align, {t, g}).pieces.size();
                    }));
  }
  return {best * 1e6 / f.ranks(), static_cast<double>(pieces) / f.ranks()};
}

// Address space for a shard without memory behind it (PROT_NONE, never touched): planning never
// reads data, but its views must point somewhere.
const std::byte* no_memory(std::size_t bytes) {
  static const std::size_t size = bytes;
  static void* const base = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  require(base != MAP_FAILED && bytes <= size, Errc::internal, "cannot reserve ", bytes, " bytes of address space");
  return static_cast<const std::byte*>(base);
}

// The state dict of one rank of the whole seed model (in_proj, conv1d, out_proj, norm per layer),
// its shards borrowed from address space without memory: planning never touches data.
StateDict seed_rank(const Seed& f, const std::vector<ParamSpec>& all, int rank) {
  StateDict state;
  for (const ParamSpec& spec : all) {
    ShardedParam p{spec, f.gtp, f.align, {rank / f.gtp, rank % f.gtp}, DType::bf16};
    const Extents shape = p.shard_shape();
    require(static_cast<std::size_t>(shape.elements()) * dtype_size(DType::bf16) <= std::size_t{1} << 30,
            Errc::internal, "a seed shard larger than 1 GiB");
    p.shard = unchecked_borrow(TensorView::unchecked(no_memory(std::size_t{1} << 30), DType::bf16, shape));
    state.add(std::move(p));
  }
  return state;
}

void plan_whole_model(const Seed& f, Report& report) {
  demo::ModelConfig seed;
  seed.gdp_layers = f.layers;
  seed.mamba_layers = 0;
  seed.dims = f.dims;
  seed.cols = f.cols;
  const std::vector<ParamSpec> all = demo::params(seed, f.tp);
  ::malloc_trim(0);
  const std::int64_t rss0 = proc_status_bytes("VmRSS:");
  std::vector<Claim> claims;
  double seconds = 0;
  std::int64_t rank0_bytes = 0, encoded = 0;
  for (int r = 0; r < f.ranks(); ++r) {
    const StateDict state = seed_rank(f, all, r);
    std::vector<Claim> mine;
    seconds += timed([&] { mine = claims_of(prepare_save(state), r); });
    if (r == 0)
      for (const SaveItem& i : prepare_save(state).items) rank0_bytes += static_cast<std::int64_t>(i.data.bytes());
    claims.insert(claims.end(), std::make_move_iterator(mine.begin()), std::make_move_iterator(mine.end()));
  }
  claims.shrink_to_fit();
  const std::int64_t claims_bytes = proc_status_bytes("VmRSS:") - rss0;
  // What rank 0 receives in a save (src/dist.cpp's encoding: key, dtype, global shape, box, writes).
  for (const Claim& c : claims) encoded += static_cast<std::int64_t>(8 + c.key.size() + 1 + 8 + 8 * c.global_shape.size() + 32 + 1);
  const double validate_ms = timed([&] { validate_claims(claims); }) * 1e3;
  report.add("prepare_save_all_params_us_per_rank", seconds * 1e6 / f.ranks(), cat("(", all.size(), " parameters)"));
  report.add("validate_claims_ms", validate_ms, cat("(", claims.size(), " claims of ", f.ranks(), " ranks, at rank 0)"));
  report.set("world_claims", claims.size());
  report.set("world_claims_bytes", claims_bytes);
  report.set("world_claims_encoded_bytes", encoded);
  // Rank 0 turns claims into Claim values 16,384 at a time.
  report.set("rank0_part_bytes", claims_bytes * std::min<std::int64_t>(16 * 1024, static_cast<std::int64_t>(claims.size())) /
                                     static_cast<std::int64_t>(claims.size()));
  report.set("seed_rank_bytes", rank0_bytes);
}

}  // namespace

void measure_planning(Report& report) {
  const Seed f;
  std::vector<ParamSpec> specs;
  const auto [us, pieces] = plan_in_proj(f, specs);
  report.add("plan_seed_scale_us_per_rank", us, "<= 1000", us <= 1000);
  report.set("plan_seed_scale", {{"layers", f.layers}, {"tp", f.tp}, {"gtp", f.gtp}, {"align", f.align},
                                 {"in_proj_rows", specs[0].rows()}, {"in_proj_cols", f.cols},
                                 {"in_proj_blocks", specs[0].sections.size()}, {"pieces_per_rank", pieces}});
  plan_whole_model(f, report);
}

}  // namespace bench
