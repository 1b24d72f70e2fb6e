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
#include <variant>
#include <vector>
module shardckpt.demo;
import shardckpt.io;

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

template <class T>
bool all_zero(TensorView rows) {
  for (const T& x : rows.as<T>())
    if (!(x == T{})) return false;
  return true;
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

ShardedParam param_entry(const ParamSpec& spec, const ModelConfig& config, const Layout& layout, RankCoord c) {
  return {spec, layout.gtp, layout.align, {c.tp, c.gtp}, config.dtype, c.dp, {}};
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
  const std::int64_t d_inner = c.dims.heads * c.dims.head_dim;
  require(d_inner % tp == 0, Errc::layout, "heads x head_dim (", d_inner, ") does not divide by TP ", tp);
  std::vector<ParamSpec> out;
  for (int layer = 0; layer < c.gdp_layers + c.mamba_layers; ++layer) {
    const bool gdp = layer < c.gdp_layers;
    out.push_back({layer_key(layer, "mixer.in_proj.weight"),
                   gdp ? gdp_in_proj_sections(c.dims, tp) : mamba_in_proj_sections(c.dims, tp),
                   {c.cols},
                   TpAxis::rows,
                   tp});
    out.push_back({layer_key(layer, "mixer.conv1d.weight"),
                   gdp ? gdp_conv1d_sections(c.dims, tp) : mamba_conv1d_sections(c.dims, tp),
                   {1, c.conv_kernel},
                   TpAxis::rows,
                   tp});
    out.push_back(
        {layer_key(layer, "mixer.out_proj.weight"), plain_sections(c.cols), {d_inner / tp}, TpAxis::cols, tp});
    out.push_back({layer_key(layer, "norm.weight"), plain_sections(c.cols), {}, TpAxis::replicated, tp});
  }
  return out;
}

std::int64_t model_bytes(const ModelConfig& config) {
  std::int64_t n = 0;
  for (const ParamSpec& spec : params(config, 1))
    for (const Block& b : blocks(spec))
      n = checked_add(n, checked_mul(element_count(b.global_shape), static_cast<std::int64_t>(dtype_size(config.dtype)),
                                     "model bytes"),
                      "model bytes");
  return n;
}

RankModel build_rank(const ModelConfig& config, const Layout& layout, int rank) {
  const RankCoord c = coord_of(layout, rank);
  RankModel m;
  for (const ParamSpec& spec : params(config, layout.tp)) {
    ShardedParam entry = param_entry(spec, config, layout, c);
    const RankPlan plan = plan_rank(spec, layout.gtp, layout.align, {c.tp, c.gtp});
    HostBuffer shard = HostBuffer::zeros(config.dtype, entry.shard_shape());
    const MutTensorView rows = shard.mut_view();
    for_each_row(plan, [&](const Piece& p, std::int64_t r, std::uint64_t seed, std::int64_t) {
      const MutTensorView row = rows.rows(p.shard_row + r, p.shard_row + r + 1);
      config.dtype == DType::f32 ? fill_row<float>(row, seed) : fill_row<bf16>(row, seed);
    });
    entry.shard = shard.view();
    m.shard_bytes += static_cast<std::int64_t>(shard.bytes());
    m.pad_rows += plan.geometry.shard_rows() - plan.real_rows;
    m.shards.push_back(std::move(shard));
    m.state.add(std::move(entry));
  }
  m.state.add_common("iteration", iteration);
  m.state.add_common("model_config", config_json(config));
  m.state.add_local("rank_seed", std::int64_t{rank});
  return m;
}

StateDict request(const ModelConfig& config, const Layout& layout, int rank) {
  const RankCoord c = coord_of(layout, rank);
  StateDict out;
  for (const ParamSpec& spec : params(config, layout.tp)) out.add(param_entry(spec, config, layout, c));
  out.add_local("rank_seed", std::int64_t{rank});
  return out;
}

Verification verify_tensors(const ModelConfig& config, const Layout& layout, int rank, const LoadedState& loaded) {
  const RankCoord c = coord_of(layout, rank);
  Verification v;
  auto mismatch = [&](std::string text) {
    if (v.mismatches++ == 0) v.first_mismatch = cat("rank ", rank, ": ", text);
  };
  for (const ParamSpec& spec : params(config, layout.tp)) {
    const RankPlan plan = plan_rank(spec, layout.gtp, layout.align, {c.tp, c.gtp});
    const HostBuffer& shard = loaded.tensor(spec.key);
    const Extents want = param_entry(spec, config, layout, c).shard_shape();
    if (!(shard.shape() == want) || shard.dtype() != config.dtype) {
      mismatch(cat(spec.key, ": loaded shard has the wrong shape or dtype"));
      continue;
    }
    const TensorView rows = shard.view();
    const bool f32 = config.dtype == DType::f32;
    for_each_row(plan, [&](const Piece& p, std::int64_t r, std::uint64_t seed, std::int64_t n) {
      const TensorView row = rows.rows(p.shard_row + r, p.shard_row + r + 1);
      const std::int64_t bad = f32 ? first_difference<float>(row, seed) : first_difference<bf16>(row, seed);
      if (bad >= 0)
        mismatch(cat(p.key, ": shard row ", p.shard_row + r, " element ", bad, " differs from the pattern"));
      v.values += n;
    });
    const TensorView pad = rows.rows(plan.real_rows, want.rows());
    if (!(f32 ? all_zero<float>(pad) : all_zero<bf16>(pad))) mismatch(cat(spec.key, ": a pad row is not zero"));
    v.pad_rows += pad.rows();
  }
  return v;
}

Verification verify(const ModelConfig& config, const Layout& layout, int rank, const LoadedState& loaded) {
  Verification v = verify_tensors(config, layout, rank, loaded);
  auto mismatch = [&](std::string text) {
    if (v.mismatches++ == 0) v.first_mismatch = cat("rank ", rank, ": ", text);
  };
  const auto check_value = [&](std::string_view key, const CommonValue& want) {
    if (!loaded.contains(key) || !(loaded.value(key) == want)) mismatch(cat("value ", key, " did not round-trip"));
  };
  check_value("iteration", iteration);
  check_value("model_config", config_json(config));
  check_value("rank_seed", std::int64_t{rank});
  return v;
}

std::int64_t gather_save(const ModelConfig& config, const Layout& layout, const std::vector<RankModel>& models,
                         const std::filesystem::path& path) {
  require(layout.dp == 1 && static_cast<int>(models.size()) == layout.ranks(), Errc::invalid_argument,
          "gather_save needs one model per rank of a DP-1 layout");
  const std::vector<ParamSpec> specs = params(config, layout.tp);
  // What the first GTP rank of each TP rank writes, in order: every block of the TP-local weight.
  struct Write {
    std::size_t param, dataset;
    std::int64_t tp_rank;
    Block block;
    std::vector<std::int64_t> offset, count;
  };
  std::vector<Write> writes;
  std::vector<DatasetSpec> datasets;
  std::vector<ParamRecord> records;
  for (std::size_t p = 0; p < specs.size(); ++p) {
    const ParamSpec& spec = specs[p];
    const std::vector<Block> bl = blocks(spec);
    for (std::size_t j = 0; j < bl.size(); ++j)
      datasets.push_back({bl[j].key, config.dtype, bl[j].global_shape, std::nullopt, {}, {}});
    for (std::int64_t t = 0; t < (spec.tp_axis == TpAxis::replicated ? 1 : spec.tp); ++t)
      for (std::size_t j = 0; j < bl.size(); ++j) {
        Write w{p, datasets.size() - bl.size() + j, t, bl[j], std::vector<std::int64_t>(bl[j].global_shape.size(), 0),
                {bl[j].local_rows.size()}};
        w.count.insert(w.count.end(), spec.trailing.begin(), spec.trailing.end());
        if (spec.tp_axis == TpAxis::rows) w.offset[0] = t * bl[j].local_rows.size();
        if (spec.tp_axis == TpAxis::cols) w.offset[1] = t * spec.trailing[0];
        writes.push_back(std::move(w));
      }
    records.push_back(record_of(spec));
  }
  std::int64_t units = 0;
  for (const Write& w : writes) {
    const Box box =
        footprint(Claim{w.block.key, config.dtype, w.block.global_shape, w.offset, w.count, 0, true});
    datasets[w.dataset].slabs.push_back({box, units});
    units += units_of(box);
  }
  const std::filesystem::path partial = partial_path(path);
  const Skeleton skeleton = create_skeleton(
      partial, datasets,
      {CheckpointKind::global, records, {{"iteration", iteration}, {"model_config", config_json(config)}}, io::random_id()},
      units);
  PieceWriter writer(partial, IoMethod::direct, ChecksumSlot{skeleton.checksums_address, 0});
  std::int64_t peak = 0;
  for (std::size_t w = 0; w < writes.size();) {
    const ParamSpec& spec = specs[writes[w].param];
    // The all-gather: the real rows of every GTP rank's shard, stacked into the TP-local weight.
    std::vector<TensorView> parts;
    const GtpGeometry geo = GtpGeometry::make(spec.rows(), layout.gtp, layout.align);
    for (int g = 0; g < layout.gtp; ++g) {
      const auto rank = static_cast<std::size_t>(writes[w].tp_rank * layout.gtp + g);
      parts.push_back(models[rank].shards[writes[w].param].view().rows(0, geo.real_count(g)));
    }
    const HostBuffer weight = materialize(parts);
    peak = std::max<std::int64_t>(peak, static_cast<std::int64_t>(weight.bytes()));
    const std::size_t param = writes[w].param;
    const std::int64_t tp_rank = writes[w].tp_rank;
    for (; w < writes.size() && writes[w].param == param && writes[w].tp_rank == tp_rank; ++w)
      writer.write(skeleton.datasets[writes[w].dataset], writes[w].offset, writes[w].count,
                   weight.view().rows(writes[w].block.local_rows.begin, writes[w].block.local_rows.end));
  }
  writer.finish();
  mark_complete(partial, skeleton.data);
  commit(partial, path);
  return peak;
}

}  // namespace shardckpt::demo
