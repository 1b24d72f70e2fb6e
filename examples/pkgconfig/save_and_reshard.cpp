// A training job's checkpoint, end to end: TP 2 x GTP 2 ranks (threads here; processes with MPI) each
// hold a padded shard of a fused GatedDeltaProduct in_proj and of a row-parallel out_proj, save them
// as one checkpoint without gathering anything, and TP 1 x GTP 3 ranks load it back at alignment 8
// and check every value and the saved iteration. Usage: save_and_reshard CHECKPOINT
// The includes are what the file itself uses (docs/user-guide.md, section 12); the rest comes
// with `import shardckpt;`.
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <variant>
#include <vector>
import shardckpt;

namespace sc = shardckpt;

namespace {

const sc::SsmDims dims{.heads = 8, .head_dim = 16, .groups = 4, .state = 16, .householder = 2};
constexpr std::int64_t hidden = 256;

// The model's parameters as TP rank `tp` of `tp` holds them.
std::vector<sc::ParamSpec> model(std::int64_t tp) {
  return {{.key = "decoder.layers.0.mixer.in_proj.weight",
           .sections = sc::gdp_in_proj_sections(dims, tp),
           .trailing = {hidden},
           .tp_axis = sc::TpAxis::rows,
           .tp = tp,
           .divisors = sc::ssm_divisors(dims)},
          {.key = "decoder.layers.0.mixer.out_proj.weight",
           .sections = sc::plain_sections(hidden),
           .trailing = {dims.heads * dims.head_dim / tp},
           .tp_axis = sc::TpAxis::cols,
           .tp = tp,
           .divisors = {{"heads", dims.heads}}}};
}

// Element (row, col) of the dataset `key`, exact in f32: what a trained weight would be.
float value(const std::string& key, std::int64_t row, std::int64_t col) {
  return static_cast<float>(key.size() * 1000 + (row * 7 + col) % 4096);
}

// Calls fn(shard row, dataset row, first dataset column, columns) for every real row of this rank's
// shard: a plan's pieces say where each run of shard rows lies in its block's dataset.
template <class Fn>
void for_each_row(const sc::ShardedParam& p, Fn&& fn) {
  const sc::RankPlan plan = sc::plan_rank(p.spec, p.gtp, p.align, p.coord);
  for (const sc::Piece& piece : plan.pieces) {
    const std::int64_t col0 = piece.global_offset.size() > 1 ? piece.global_offset[1] : 0;
    for (std::int64_t r = 0; r < piece.rows; ++r)
      fn(piece, piece.shard_row + r, piece.global_offset[0] + r, col0, plan.row_elems);
  }
}

sc::ShardedParam param(const sc::ParamSpec& spec, std::int64_t gtp, std::int64_t align, sc::ShardCoord coord) {
  return {.spec = spec, .gtp = gtp, .align = align, .coord = coord, .dtype = sc::DType::f32};
}

void save(const std::string& path) {
  const std::int64_t tp = 2, gtp = 2, align = 16;
  sc::run_ranks(tp * gtp, [&](sc::ProcessGroup& group) {
    const sc::ShardCoord coord{.tp_rank = group.rank() / gtp, .gtp_rank = group.rank() % gtp};
    sc::StateDict state;  // shares the ownership of this rank's shards
    for (const sc::ParamSpec& spec : model(tp)) {
      sc::ShardedParam p = param(spec, gtp, align, coord);
      sc::SharedBuffer shard = sc::SharedBuffer::zeros(p.dtype, p.shard_shape());
      const auto values = shard.mut_view().as<float>();
      for_each_row(p, [&](const sc::Piece& piece, std::int64_t shard_row, std::int64_t row, std::int64_t col0,
                          std::int64_t cols) {
        for (std::int64_t c = 0; c < cols; ++c) values[shard_row * cols + c] = value(piece.key, row, col0 + c);
      });
      p.shard = shard;
      state.add(p);
    }
    state.add_common("iteration", std::int64_t{1000});
    sc::save(state, path, group);  // collective: every rank writes its own rows, rank 0 commits
  });
}

// Loads at TP 1 x GTP 3, alignment 8, and returns the number of values that differ.
std::int64_t load_and_check(const std::string& path) {
  const std::int64_t tp = 1, gtp = 3, align = 8;
  std::int64_t wrong = 0;
  sc::run_ranks(tp * gtp, [&](sc::ProcessGroup& group) {
    const sc::ShardCoord coord{.tp_rank = 0, .gtp_rank = group.rank()};
    sc::StateDict request;  // what this rank holds at the new layout, without data
    for (const sc::ParamSpec& spec : model(tp)) request.add(param(spec, gtp, align, coord));
    const sc::LoadedState loaded = sc::load(path, request, group);
    std::int64_t bad = 0;
    for (const sc::ShardedParam& p : request.params()) {
      const auto values = loaded.tensor(p.spec.key).view().as<float>();
      for_each_row(p, [&](const sc::Piece& piece, std::int64_t shard_row, std::int64_t row, std::int64_t col0,
                          std::int64_t cols) {
        for (std::int64_t c = 0; c < cols; ++c) bad += values[shard_row * cols + c] != value(piece.key, row, col0 + c);
      });
      const std::int64_t real = sc::plan_rank(p.spec, p.gtp, p.align, p.coord).real_rows;
      for (auto i = static_cast<std::size_t>(real * p.spec.row_elems()); i < values.size(); ++i) bad += values[i] != 0;
    }
    // A common value comes back in the loaded state's Values (a std::map of std::variant).
    bad += std::get<std::int64_t>(loaded.values().at("iteration")) != 1000;
    static std::mutex m;
    const std::lock_guard lock(m);
    wrong += bad;
  });
  return wrong;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT\n", argv[0]);
    return 2;
  }
  try {
    save(argv[1]);
    const std::int64_t wrong = load_and_check(argv[1]);
    std::printf("saved at TP 2 x GTP 2, loaded at TP 1 x GTP 3: %s\n", wrong ? "MISMATCH" : "every value equal");
    return wrong ? 1 : 0;
  } catch (const sc::Error& e) {
    std::fprintf(stderr, "%s: %s\n", std::string(sc::errc_name(e.code())).c_str(), e.what());
    return 2;
  }
}
