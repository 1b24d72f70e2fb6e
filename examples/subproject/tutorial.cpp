// The program of docs/tutorial.md: four ranks (TP 2 x GTP 2) save their shards of one fused weight
// as tutorial.h5; then two ranks (TP 1 x GTP 2) load it at their own layout and save it again as
// resharded.h5. Both files hold the same tensors, which h5py reads as plain arrays.
#include <cstdint>
#include <cstdio>
#include <string>
import shardckpt;

namespace sc = shardckpt;

// The fused in_proj of one GatedDeltaProduct layer, as TP rank `tp_rank` of `tp` holds it.
sc::ShardedParam in_proj(std::int64_t tp, std::int64_t gtp, std::int64_t align, sc::ShardCoord coord) {
  const sc::SsmDims dims{.heads = 4, .head_dim = 8, .groups = 2, .state = 8, .householder = 2};
  const sc::ParamSpec spec{.key = "layers.0.in_proj.weight",
                           .sections = sc::gdp_in_proj_sections(dims, tp),
                           .trailing = {64},
                           .tp_axis = sc::TpAxis::rows,
                           .tp = tp,
                           .divisors = sc::ssm_divisors(dims)};
  return {.spec = spec, .gtp = gtp, .align = align, .coord = coord, .dtype = sc::DType::f32};
}

void save_original(const char* path) {
  const std::int64_t tp = 2, gtp = 2;
  sc::run_ranks(tp * gtp, [&](sc::ProcessGroup& group) {
    sc::ShardedParam p = in_proj(tp, gtp, 16, {.tp_rank = group.rank() / gtp, .gtp_rank = group.rank() % gtp});
    // This rank's padded shard: real rows first, zero pad rows at the tail. The state dict shares
    // its ownership, so the memory lives as long as either of them.
    sc::SharedBuffer shard = sc::SharedBuffer::zeros(p.dtype, p.shard_shape());
    const auto values = shard.mut_view().as<float>();
    const sc::RankPlan plan = sc::plan_rank(p.spec, p.gtp, p.align, p.coord);
    // Each piece is a run of shard rows that lands in one block's dataset, at a global offset.
    for (const sc::Piece& piece : plan.pieces)
      for (std::int64_t r = 0; r < piece.rows; ++r)
        for (std::int64_t c = 0; c < plan.row_elems; ++c)
          values[(piece.shard_row + r) * plan.row_elems + c] = static_cast<float>(piece.global_offset[0] + r);
    p.shard = shard;
    sc::StateDict state;
    state.add(p);
    state.add_common("step", std::int64_t{100});
    sc::save(state, path, group);
  });
}

void reshard(const char* from, const char* to) {
  const std::int64_t tp = 1, gtp = 2;
  sc::run_ranks(tp * gtp, [&](sc::ProcessGroup& group) {
    sc::ShardedParam p = in_proj(tp, gtp, 8, {.tp_rank = 0, .gtp_rank = group.rank()});
    sc::StateDict request;
    request.add(p);  // no data: what this rank holds at the new layout
    sc::LoadedState loaded = sc::load(from, request, group);  // owns the loaded shards
    p.shard = loaded.tensor(p.spec.key);                        // the state dict shares them
    sc::StateDict state;
    state.add(p);
    state.add_common("step", loaded.value("step"));
    sc::save(state, to, group);
  });
}

int main() {
  try {
    save_original("tutorial.h5");
    reshard("tutorial.h5", "resharded.h5");
    std::printf("saved tutorial.h5 at TP 2 x GTP 2 and resharded.h5 at TP 1 x GTP 2\n");
  } catch (const sc::Error& e) {
    std::fprintf(stderr, "%s: %s\n", std::string(sc::errc_name(e.code())).c_str(), e.what());
    return 2;
  }
}
