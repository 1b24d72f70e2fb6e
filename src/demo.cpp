module;
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.demo;
import shardckpt.storage;

namespace shardckpt::demo {
namespace {

std::string layer_key(int layer, std::string_view name) { return cat("decoder.layers.", layer, ".", name); }

// Calls fn(piece, row r of the piece, pattern seed of its first element, elements per row) for every
// row of every piece of a rank's plan, replicas included. The element i of the row has the pattern
// value (seed + i) mod 2^24: the seed is fnv1a32(key) plus the row's flat index in the dataset.
template <class Fn>
void for_each_row(const RankPlan& plan, Fn&& fn) {
  for (const Piece& p : plan.pieces) {
    const std::uint64_t hash = fnv1a32(p.key);
    const std::int64_t row_elems = element_count(std::span(p.global_shape).subspan(1));
    const std::int64_t col0 =
        p.global_shape.size() > 1 ? p.global_offset[1] * element_count(std::span(p.global_shape).subspan(2)) : 0;
    for (std::int64_t r = 0; r < p.rows; ++r)
      fn(p, r, hash + static_cast<std::uint64_t>((p.global_offset[0] + r) * row_elems + col0), plan.row_elems);
  }
}

constexpr std::uint64_t pattern_modulus = std::uint64_t{1} << 24;

float pattern_value(std::uint64_t seed) noexcept { return static_cast<float>(seed % pattern_modulus); }

// The element as the model's dtype stores it.
template <class T>
T stored(float v) noexcept {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return to_bf16(v);
}

template <class T>
void fill_row(MutTensorView row, std::uint64_t seed) {
  std::uint64_t v = seed;
  for (T& out : row.as<T>()) out = stored<T>(pattern_value(v++));
}

// Index of the first element of `row` that differs from the pattern, or -1.
template <class T>
std::int64_t first_difference(TensorView row, std::uint64_t seed) {
  const auto values = row.as<T>();
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!(values[i] == stored<T>(pattern_value(seed + i)))) return static_cast<std::int64_t>(i);
  return -1;
}

// Marks the model_config of a demo checkpoint: its elements follow the pattern.
constexpr std::string_view pattern_name = "shardckpt demo: (fnv1a32(key) + i) mod 2^24";

}  // namespace

std::string config_json(const ModelConfig& c) {
  return nlohmann::json{{"pattern", pattern_name},
                        {"gdp_layers", c.gdp_layers},
                        {"mamba_layers", c.mamba_layers},
                        {"heads", c.dims.heads},
                        {"head_dim", c.dims.head_dim},
                        {"groups", c.dims.groups},
                        {"state", c.dims.state},
                        {"householder", c.dims.householder},
                        {"cols", c.cols},
                        {"conv_kernel", c.conv_kernel},
                        {"dtype", dtype_name(c.dtype)}}
      .dump();
}

std::optional<ModelConfig> config_of(const CheckpointContents& contents) {
  const auto it = contents.common.find("model_config");
  if (it == contents.common.end() || !std::holds_alternative<std::string>(it->second)) return std::nullopt;
  try {
    const nlohmann::json j = nlohmann::json::parse(std::get<std::string>(it->second));
    if (j.value("pattern", "") != pattern_name) return std::nullopt;
    ModelConfig c;
    c.gdp_layers = j.at("gdp_layers").get<int>();
    c.mamba_layers = j.at("mamba_layers").get<int>();
    c.dims = {.heads = j.at("heads").get<std::int64_t>(),
              .head_dim = j.at("head_dim").get<std::int64_t>(),
              .groups = j.at("groups").get<std::int64_t>(),
              .state = j.at("state").get<std::int64_t>(),
              .householder = j.at("householder").get<std::int64_t>()};
    c.cols = j.at("cols").get<std::int64_t>();
    c.conv_kernel = j.at("conv_kernel").get<std::int64_t>();
    c.dtype = parse_dtype(j.at("dtype").get<std::string>());
    return c;
  } catch (const std::exception&) {  // someone else's model_config
    return std::nullopt;
  }
}

namespace {

constexpr std::int64_t iteration = 1000;

// Adam's hyperparameters, saved as common values with the step.
const std::pair<std::string_view, double> adam_hyper[] = {
    {"optimizer.lr", 3e-4}, {"optimizer.beta1", 0.9}, {"optimizer.beta2", 0.95}, {"optimizer.eps", 1e-8},
    {"optimizer.weight_decay", 0.1}};

// The entries of one rank: every parameter (copies across DP write and read balanced shares) and,
// with Adam, its three f32 companions (whole shards, or each DP rank's flat range).
std::vector<ShardedParam> entries(const ModelConfig& config, const Layout& layout, RankCoord c, const Training& t) {
  std::vector<ShardedParam> out;
  for (const ParamSpec& spec : params(config, layout.tp)) {
    ShardedParam p{spec, layout.gtp, layout.align, {c.tp, c.gtp}, config.dtype};
    p.replica_id = c.dp;
    p.replicas = layout.dp;
    out.push_back(p);
  }
  if (!t.adam) return out;
  const std::size_t n = out.size();
  for (std::string_view name : adam_states)
    for (std::size_t i = 0; i < n; ++i) {
      ShardedParam s = optimizer_state(out[i], name, DType::f32);
      if (t.distributed) {
        s.flat = distributed_range(s, c.dp, layout.dp);
        s.replica_id = 0;
        s.replicas = 1;
      }
      out.push_back(std::move(s));
    }
  return out;
}

// Calls fn(flat offset in the shard, elements, pattern seed of the first) for every run of real
// elements a shard holds, and returns the elements of the shard that are padding: [pad_begin, end).
struct Runs {
  std::int64_t pad_begin = 0, pad_end = 0;
};
template <class Fn>
Runs for_each_run(const ShardedParam& p, Fn&& fn) {
  const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
  const std::int64_t real = plan.real_rows * plan.row_elems;
  if (!p.flat) {
    for_each_row(plan, [&](const Piece& piece, std::int64_t r, std::uint64_t seed, std::int64_t n) {
      fn((piece.shard_row + r) * n, n, seed);
    });
    return {real, p.padded_shape().elements()};
  }
  for (const Piece& piece : plan.pieces) {
    const std::uint64_t hash = fnv1a32(piece.key);
    const std::int64_t width = element_count(std::span(piece.global_shape).subspan(1));
    for (const FlatPart& part : flat_parts(piece, plan.row_elems, {p.flat->begin, p.flat->end}))
      for (std::int64_t r = part.box.rows.begin; r < part.box.rows.end; ++r)
        fn(part.range_offset + (r - part.box.rows.begin) * part.box.cols.size(), part.box.cols.size(),
           hash + static_cast<std::uint64_t>(r * width + part.box.cols.begin));
  }
  return {std::clamp(real, p.flat->begin, p.flat->end) - p.flat->begin, p.flat->end - p.flat->begin};
}

template <class T>
void fill(MutTensorView shard, std::int64_t at, std::int64_t n, std::uint64_t seed) {
  for (T& out : shard.as<T>().subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(n)))
    out = stored<T>(pattern_value(seed++));
}

// Memory for a shard in `placement`'s memory, its bytes unset.
SharedBuffer allocate(DType dtype, const Extents& shape, const ShardMemory& placement) {
  switch (placement.memory) {
    case MemoryKind::host:
      return SharedBuffer::uninitialized(dtype, shape);
    case MemoryKind::pinned:
      return placement.engine ? placement.engine->allocate_pinned(dtype, shape) : allocate_locked(dtype, shape);
    case MemoryKind::device:
      require(placement.engine != nullptr, Errc::invalid_argument, "device shards need a CopyEngine");
      return placement.engine->allocate_device(dtype, shape);
  }
  return {};
}

// Puts `host` (a shard built on the host) where `to` lives.
void place(TensorView host, SharedBuffer& to, const ShardMemory& placement) {
  if (to.space().host_accessible()) {
    if (!host.empty()) std::memcpy(to.mut_view().data(), host.data(), host.bytes());
    return;
  }
  placement.engine->copy_to_device(host, to.mut_view());
  placement.engine->wait(placement.engine->fence());
}

// A shard of `shape` in `placement`'s memory holding the bytes of `host`.
SharedBuffer placed(HostBuffer host, const ShardMemory& placement) {
  if (placement.memory == MemoryKind::host) return SharedBuffer(std::move(host));
  SharedBuffer b = allocate(host.dtype(), host.shape(), placement);
  place(host.view(), b, placement);
  return b;
}

}  // namespace

std::string layout_text(const Layout& l) {
  return cat("TP ", l.tp, " x GTP ", l.gtp, " (alignment ", l.align, ")", l.dp > 1 ? cat(" x DP ", l.dp) : "");
}

nlohmann::json layout_json(const Layout& l) {
  return {{"tp", l.tp}, {"gtp", l.gtp}, {"align", l.align}, {"dp", l.dp}, {"ranks", l.ranks()}};
}

std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

RankCoord coord_of(const Layout& layout, int rank) {
  require(layout.tp >= 1 && layout.gtp >= 1 && layout.dp >= 1, Errc::invalid_argument,
          "TP, GTP and DP must be at least 1");
  require(rank >= 0 && rank < layout.ranks(), Errc::invalid_argument, "rank ", rank, " is outside a layout of ",
          layout.ranks(), " ranks");
  return {rank / (layout.tp * layout.gtp), (rank / layout.gtp) % layout.tp, rank % layout.gtp};
}

std::uint32_t fnv1a32(std::string_view bytes) noexcept {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

float pattern(std::string_view key, std::uint64_t index) noexcept { return pattern_value(fnv1a32(key) + index); }

std::vector<ParamSpec> params(const ModelConfig& c, std::int64_t tp) {
  require(c.gdp_layers >= 0 && c.mamba_layers >= 0 && c.gdp_layers + c.mamba_layers > 0, Errc::invalid_argument,
          "the model needs at least one layer");
  require(c.dtype == DType::bf16 || c.dtype == DType::f32, Errc::invalid_argument, "the demo model is bf16 or f32");
  require(c.cols > 0 && c.conv_kernel > 0, Errc::invalid_argument, "cols and the conv kernel must be positive");
  // The fused weights' sections come from the heads and groups; out_proj's columns are whole heads.
  const std::vector<TpDivisor> fused = ssm_divisors(c.dims);
  const std::vector<TpDivisor> heads{fused.front()};
  require_tp_divides(layer_key(0, "mixer.in_proj.weight"), fused, tp);
  const std::int64_t d_inner = checked_mul(c.dims.heads, c.dims.head_dim, "heads x head_dim", Errc::layout);
  std::vector<ParamSpec> out;
  for (int layer = 0; layer < c.gdp_layers + c.mamba_layers; ++layer) {
    const bool gdp = layer < c.gdp_layers;
    out.push_back({layer_key(layer, "mixer.in_proj.weight"),
                   gdp ? gdp_in_proj_sections(c.dims, tp) : mamba_in_proj_sections(c.dims, tp), {c.cols},
                   TpAxis::rows, tp, fused});
    out.push_back({layer_key(layer, "mixer.conv1d.weight"),
                   gdp ? gdp_conv1d_sections(c.dims, tp) : mamba_conv1d_sections(c.dims, tp), {1, c.conv_kernel},
                   TpAxis::rows, tp, fused});
    out.push_back({layer_key(layer, "mixer.out_proj.weight"), plain_sections(c.cols), {d_inner / tp}, TpAxis::cols,
                   tp, heads});
    out.push_back({layer_key(layer, "norm.weight"), plain_sections(c.cols), {}, TpAxis::replicated, tp, {}});
  }
  return out;
}

std::int64_t model_bytes(const ModelConfig& config, const Training& training) {
  // Adam keeps three f32 companions of every element.
  const std::int64_t per_element =
      element_bytes(config.dtype) + (training.adam ? 3 * std::int64_t{sizeof(float)} : 0);
  std::int64_t n = 0;
  for (const ParamSpec& spec : params(config, 1))
    for (const Block& b : blocks(spec))
      n = checked_add(n, checked_mul(element_count(b.global_shape), per_element, "model bytes"), "model bytes");
  return n;
}

RankModel build_rank(const ModelConfig& config, const Layout& layout, int rank, const Training& training,
                     ShardMemory placement) {
  RankModel m;
  for (ShardedParam p : entries(config, layout, coord_of(layout, rank), training)) {
    HostBuffer host = HostBuffer::zeros(p.dtype, p.shard_shape());
    const MutTensorView view = host.mut_view();
    const Runs runs = for_each_run(p, [&](std::int64_t at, std::int64_t n, std::uint64_t seed) {
      p.dtype == DType::f32 ? fill<float>(view, at, n, seed) : fill<bf16>(view, at, n, seed);
    });
    if (!p.flat) m.pad_rows += (runs.pad_end - runs.pad_begin) / std::max<std::int64_t>(1, view.shape().row_elems());
    m.shard_bytes += static_cast<std::int64_t>(view.bytes());
    p.shard = placed(std::move(host), placement);
    m.state.add(std::move(p));
  }
  m.state.add_common("iteration", iteration);
  m.state.add_common("model_config", config_json(config));
  if (training.adam) {
    m.state.add_common("optimizer.step", iteration);
    for (const auto& [key, value] : adam_hyper) m.state.add_common(std::string(key), value);
  }
  m.state.add_local("rank_seed", std::int64_t{rank});
  return m;
}

StateDict request(const ModelConfig& config, const Layout& layout, int rank, const Training& training) {
  StateDict out;
  for (ShardedParam& p : entries(config, layout, coord_of(layout, rank), training)) out.add(std::move(p));
  out.add_local("rank_seed", std::int64_t{rank});
  return out;
}

namespace {

// The entries of `request` with data(key, dtype, shape) as their tensors, and its values.
template <class Data>
StateDict with_data(const StateDict& request, Data&& data) {
  StateDict out;
  for (ShardedTensor t : request.tensors()) {
    t.data = data(t.key, t.dtype, t.shape);
    out.add(std::move(t));
  }
  for (ShardedParam p : request.params()) {
    p.shard = data(p.spec.key, p.dtype, p.shard_shape());
    out.add(std::move(p));
  }
  for (const auto& [key, value] : request.common()) out.add_common(key, value);
  for (const auto& [key, value] : request.local()) out.add_local(key, value);
  return out;
}

}  // namespace

StateDict attach(const StateDict& request, const LoadedState& loaded) {
  return with_data(request, [&](const std::string& key, DType, const Extents&) { return loaded.tensor(key); });
}

StateDict with_destinations(const StateDict& request, ShardMemory placement) {
  return with_data(request, [&](const std::string&, DType dtype, const Extents& shape) {
    HostBuffer host = HostBuffer::uninitialized(dtype, shape);
    if (host.bytes()) std::memset(host.mut_view().data(), 0xff, host.bytes());
    return placed(std::move(host), placement);
  });
}

Verification verify_tensors(const StateDict& filled, int rank, CopyEngine* engine, bool pattern) {
  Verification v;
  auto mismatch = [&](std::string text) {
    if (v.mismatches++ == 0) v.first_mismatch = cat("rank ", rank, ": ", text);
  };
  for (const ShardedParam& p : filled.params()) {
    const Extents want = p.shard_shape();
    if (!p.shard || !(p.shard.shape() == want) || p.shard.dtype() != p.dtype) {
      mismatch(cat(p.spec.key, ": the loaded shard has the wrong shape or dtype"));
      continue;
    }
    // A device shard comes to the host first: one shard at a time.
    HostBuffer copy;
    TensorView shard = p.shard.view();
    if (!shard.space().host_accessible()) {
      require(engine != nullptr, Errc::invalid_argument, "checking a device shard needs its CopyEngine");
      copy = HostBuffer::uninitialized(p.dtype, want);
      engine->copy_to_host(shard, copy.mut_view());
      engine->wait(engine->fence());
      shard = copy.view();
    }
    const bool f32 = p.dtype == DType::f32;
    const Runs runs = for_each_run(p, [&](std::int64_t at, std::int64_t n, std::uint64_t seed) {
      if (!pattern) return;
      const TensorView run = TensorView::unchecked(shard.data() + at * element_bytes(p.dtype),
                                                p.dtype, {n});
      const std::int64_t bad = f32 ? first_difference<float>(run, seed) : first_difference<bf16>(run, seed);
      if (bad >= 0) mismatch(cat(p.spec.key, ": element ", at + bad, " of the shard differs from the pattern"));
      v.values += n;
    });
    // Pad elements of any dtype are zero bytes (a load zero-fills them).
    const auto es = element_bytes(p.dtype);
    const std::byte* pad = shard.data() + runs.pad_begin * es;
    if (std::any_of(pad, pad + (runs.pad_end - runs.pad_begin) * es, [](std::byte b) { return b != std::byte{0}; }))
      mismatch(cat(p.spec.key, ": a pad element is not zero"));
    if (!p.flat) v.pad_rows += (runs.pad_end - runs.pad_begin) / std::max<std::int64_t>(1, want.row_elems());
  }
  return v;
}

Verification verify(const ModelConfig& config, const Training& training, int rank, const StateDict& filled,
                    const Values& values, CopyEngine* engine) {
  Verification v = verify_tensors(filled, rank, engine);
  auto mismatch = [&](std::string text) {
    if (v.mismatches++ == 0) v.first_mismatch = cat("rank ", rank, ": ", text);
  };
  const auto check_value = [&](std::string_view key, const CommonValue& want) {
    const auto it = values.find(key);
    if (it == values.end() || !(it->second == want)) mismatch(cat("value ", key, " did not round-trip"));
  };
  check_value("iteration", iteration);
  check_value("model_config", config_json(config));
  check_value("rank_seed", std::int64_t{rank});
  if (training.adam) {
    check_value("optimizer.step", iteration);
    for (const auto& [key, value] : adam_hyper) check_value(key, value);
  }
  return v;
}

Verification verify(const ModelConfig& config, const Training& training, int rank, const StateDict& request,
                    const LoadedState& loaded) {
  return verify(config, training, rank, attach(request, loaded), loaded.values());
}

namespace {

// What the first GTP rank of each TP rank writes in a gathered save, in order: every block of the
// TP-local weight, at its offset in the block's global dataset.
struct GatherWrite {
  std::size_t param, dataset;
  std::int64_t tp_rank;
  Block block;
  std::vector<std::int64_t> offset, count;
};

struct GatherPlan {
  std::vector<ParamSpec> specs;
  std::vector<GatherWrite> writes;
  std::vector<Dataset> datasets;
  std::vector<ParamRecord> records;
  std::int64_t checksum_rows = 0;
};

GatherPlan plan_gather(const ModelConfig& config, const Layout& layout) {
  GatherPlan plan;
  plan.specs = params(config, layout.tp);
  for (std::size_t p = 0; p < plan.specs.size(); ++p) {
    const ParamSpec& spec = plan.specs[p];
    const std::vector<Block> bl = blocks(spec);
    for (const Block& b : bl) plan.datasets.push_back({b.key, config.dtype, b.global_shape});
    for (std::int64_t t = 0; t < (spec.tp_axis == TpAxis::replicated ? 1 : spec.tp); ++t)
      for (std::size_t j = 0; j < bl.size(); ++j) {
        GatherWrite w{p, plan.datasets.size() - bl.size() + j, t, bl[j],
                      std::vector<std::int64_t>(bl[j].global_shape.size(), 0), {bl[j].local_rows.size()}};
        w.count.insert(w.count.end(), spec.trailing.begin(), spec.trailing.end());
        if (spec.tp_axis == TpAxis::rows) w.offset[0] = t * bl[j].local_rows.size();
        if (spec.tp_axis == TpAxis::cols) w.offset[1] = t * spec.trailing[0];
        plan.writes.push_back(std::move(w));
      }
    plan.records.push_back(record_of(spec));
  }
  for (const GatherWrite& w : plan.writes) {
    const Box box = footprint(w.block.key, w.block.global_shape, w.offset, w.count);
    plan.datasets[w.dataset].slabs.push_back({box, plan.checksum_rows});
    plan.checksum_rows += checksum_rows_of(box);
  }
  return plan;
}

// The all-gather: the real rows of every GTP rank's shard of one parameter, stacked into the
// TP-local weight (a counted materialization).
HostBuffer gather_weight(const GatherPlan& plan, const GatherWrite& write, const Layout& layout,
                         const std::vector<RankModel>& models) {
  std::vector<TensorView> parts;
  const GtpGeometry geo = GtpGeometry::make(plan.specs[write.param].rows(), layout.gtp, layout.align);
  for (int g = 0; g < layout.gtp; ++g) {
    const auto rank = static_cast<std::size_t>(write.tp_rank * layout.gtp + g);
    parts.push_back(models[rank].state.params()[write.param].shard.view().slice_rows(0, geo.real_count(g)));
  }
  return materialize(parts);
}

}  // namespace

std::int64_t gather_save(const ModelConfig& config, const Layout& layout, const std::vector<RankModel>& models,
                         const std::filesystem::path& path) {
  require(layout.dp == 1 && static_cast<int>(models.size()) == layout.ranks(), Errc::invalid_argument,
          "gather_save needs one model per rank of a DP-1 layout");
  const GatherPlan plan = plan_gather(config, layout);
  CheckpointWriter checkpoint = CheckpointWriter::create(
      io::Destination::of(path), plan.datasets,
      {CheckpointKind::global, plan.records, {{"iteration", iteration}, {"model_config", config_json(config)}}, io::random_id()},
      plan.checksum_rows);
  const Skeleton& skeleton = checkpoint.skeleton();
  PieceWriter writer = checkpoint.pieces(IoMethod::raw, 0);
  std::int64_t peak = 0;
  const auto& writes = plan.writes;
  for (std::size_t w = 0; w < writes.size();) {
    const HostBuffer weight = gather_weight(plan, writes[w], layout, models);
    peak = std::max<std::int64_t>(peak, static_cast<std::int64_t>(weight.bytes()));
    const std::size_t param = writes[w].param;
    const std::int64_t tp_rank = writes[w].tp_rank;
    for (; w < writes.size() && writes[w].param == param && writes[w].tp_rank == tp_rank; ++w)
      writer.write(skeleton.datasets[writes[w].dataset], writes[w].offset, writes[w].count,
                   weight.view().slice_rows(writes[w].block.local_rows.begin, writes[w].block.local_rows.end));
  }
  std::move(checkpoint).written(writer.finish()).seal().commit();
  return peak;
}

}  // namespace shardckpt::demo
