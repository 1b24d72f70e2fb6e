module;
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.merge;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using Tree = std::map<std::string, LoadedState::Entry, std::less<>>;

std::string dims_text(std::span<const std::int64_t> dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

std::string where(const ShardedParam& p) {
  return cat("parameter ", p.spec.key, " (TP rank ", p.coord.tp_rank, ", GTP rank ", p.coord.gtp_rank, ")");
}

// Chunks of at most this many bytes (HDF5 caps a chunk at 4 GiB).
constexpr std::int64_t max_chunk_bytes = std::int64_t{1} << 30;

// The chunk dims of a dataset whose main pieces all split dim 1 into equal, aligned bands (row-parallel
// weights under TP): one band wide, as many rows as fit, so that each band's rows are contiguous bytes
// in the file. Empty (contiguous) for everything else.
std::vector<std::int64_t> band_chunk(const std::vector<const Claim*>& claims) {
  const std::vector<std::int64_t>& shape = claims.front()->global_shape;
  if (shape.size() < 2 || shape[0] == 0) return {};
  std::int64_t width = 0;
  for (const Claim* c : claims) {
    if (!c->main_replica || c->count[0] == 0) continue;
    if (width == 0) width = c->count[1];
    if (c->count[1] != width || width == 0 || c->global_offset[1] % width != 0) return {};
  }
  if (width == 0 || width == shape[1] || shape[1] % width != 0) return {};
  std::vector<std::int64_t> chunk = shape;
  chunk[1] = width;
  const std::int64_t row_bytes =
      static_cast<std::int64_t>(dtype_size(claims.front()->dtype)) * width * element_count(std::span(shape).subspan(2));
  chunk[0] = std::clamp<std::int64_t>(max_chunk_bytes / row_bytes, 1, shape[0]);
  return chunk;
}

// Checks that the checkpoint's dataset can serve a slab of `dtype` at `global_shape`.
void check_dataset(const DatasetInfo& d, DType dtype, std::span<const std::int64_t> global_shape,
                   std::string_view who) {
  require(d.dtype == dtype, Errc::dtype_mismatch, "key ", d.key, ": the checkpoint holds ", dtype_name(d.dtype),
          " but ", who, " asks for ", dtype_name(dtype));
  require(std::equal(d.shape.begin(), d.shape.end(), global_shape.begin(), global_shape.end()), Errc::shape_mismatch,
          "key ", d.key, ": the checkpoint holds global shape ", dims_text(d.shape), " but ", who, " expects ",
          dims_text(global_shape));
}

// Where a slab of a request lives in the file: in a global checkpoint at its global offset in the
// shared dataset; in a local one the dataset is the slab itself, placed where the request says.
struct Source {
  const CheckpointReader& reader;
  bool local;
  IoMethod method;

  void read(std::string_view key, DType dtype, std::span<const std::int64_t> global_shape,
            std::span<const std::int64_t> global_offset, std::span<const std::int64_t> count, MutTensorView dst,
            std::string_view who) const {
    const DatasetInfo& d = reader.dataset(key);
    if (!local) {
      check_dataset(d, dtype, global_shape, who);
      reader.read(d, global_offset, count, dst, method);
      return;
    }
    check_dataset(d, dtype, count, who);
    const PiecePlacement want{{global_shape.begin(), global_shape.end()}, {global_offset.begin(), global_offset.end()}};
    require(d.placement == want, Errc::shape_mismatch, "key ", key, ": the local checkpoint ", reader.path().string(),
            " was saved at another layout (", who, " expects offset ", dims_text(global_offset), ")");
    const std::vector<std::int64_t> zero(count.size(), 0);
    reader.read(d, zero, count, dst, method);
  }
};

// Loads every sharded entry of the request into the tree: plain shards as new buffers, factories as
// their padded shard (pieces read into its rows, pad rows zeroed) or, on a padding-only rank, as
// the zero-element placeholder that the save kept.
void load_shards(const Source& src, const StateDict& request, Tree& tree) {
  for (const ShardedTensor& t : request.tensors()) {
    HostBuffer buf = HostBuffer::uninitialized(t.dtype, t.shape);
    src.read(t.key, t.dtype, t.global_shape, t.global_offset, t.shape.dims(), buf.mut_view(), cat("tensor ", t.key));
    tree.emplace(t.key, std::move(buf));
  }
  for (const ShardedParam& p : request.params()) {
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    const Extents shape = p.shard_shape();
    if (plan.padding_only) {
      if (src.local) {
        const DatasetInfo& d = src.reader.dataset(p.spec.key);
        require(d.placeholder, Errc::shape_mismatch, where(p),
                ": the local checkpoint holds no placeholder under its key");
        check_dataset(d, p.dtype, shape.with_rows(0).dims(), where(p));
      }
      tree.emplace(p.spec.key, HostBuffer::zeros(p.dtype, shape.with_rows(0)));
      continue;
    }
    HostBuffer shard = HostBuffer::uninitialized(p.dtype, shape);
    const MutTensorView rows = shard.mut_view();
    for (const Piece& piece : plan.pieces)
      src.read(piece.key, p.dtype, piece.global_shape, piece.global_offset, piece.count,
               rows.rows(piece.shard_row, piece.shard_row + piece.rows), where(p));
    const MutTensorView pad = rows.rows(plan.real_rows, shape.rows());
    if (!pad.empty()) std::memset(pad.data(), 0, pad.bytes());
    tree.emplace(p.spec.key, std::move(shard));
  }
}

// Factory merges, applied to the complete tree: a padding-only rank's placeholder becomes its
// all-zero shard; a loaded shard is checked against the factory's shape. A factory whose key is
// missing from the tree means the loaded keys differ from the requested ones.
void merge_factories(const StateDict& request, Tree& tree) {
  for (const ShardedParam& p : request.params()) {
    const auto it = tree.find(p.spec.key);
    require(it != tree.end() && std::holds_alternative<HostBuffer>(it->second), Errc::missing_key, where(p),
            ": nothing was loaded under its key, so the loaded keys differ from the requested ones");
    auto& buf = std::get<HostBuffer>(it->second);
    const Extents shape = p.shard_shape();
    if (buf.shape().rows() == 0) buf = HostBuffer::zeros(p.dtype, shape);
    require(buf.shape() == shape && buf.dtype() == p.dtype, Errc::shape_mismatch, where(p),
            ": the loaded shard does not have the factory's shape ", dims_text(shape.dims()));
  }
}

LoadedState load_with(const fs::path& path, const StateDict& request, LoadOptions options, CheckpointKind kind) {
  const CheckpointReader reader(path);
  require(reader.contents().kind == kind, Errc::not_a_checkpoint, path.string(), " is a ",
          reader.contents().kind == CheckpointKind::local ? "local (per-rank)" : "global", " checkpoint; use ",
          reader.contents().kind == CheckpointKind::local ? "load_local" : "load");
  Tree tree;
  load_shards(Source{reader, kind == CheckpointKind::local, options.method}, request, tree);
  // The complete tree first (shards, common values, local values), then the factory merges.
  for (const auto& [key, value] : reader.contents().common) tree.emplace(key, value);
  for (const auto& [key, value] : request.local()) tree.insert_or_assign(key, value);
  merge_factories(request, tree);
  return LoadedState(std::move(tree));
}

}  // namespace

ShardedTensor ShardedTensor::of(std::string key, TensorView data, std::vector<std::int64_t> global_shape,
                                std::vector<std::int64_t> global_offset, int replica_id) {
  return {std::move(key),           data.dtype(), data.shape(), std::move(global_shape),
          std::move(global_offset), replica_id,   data};
}

ShardedTensor ShardedTensor::expect(std::string key, DType dtype, Extents shape, std::vector<std::int64_t> global_shape,
                                    std::vector<std::int64_t> global_offset) {
  return {std::move(key), dtype, shape, std::move(global_shape), std::move(global_offset), 0, {}};
}

Extents ShardedParam::shard_shape() const {
  std::vector<std::int64_t> dims{geometry().shard_rows()};
  dims.insert(dims.end(), spec.trailing.begin(), spec.trailing.end());
  return Extents(std::span<const std::int64_t>(dims));
}

void StateDict::claim_key(const std::string& key) {
  require(!key.empty(), Errc::invalid_argument, "a state dict key must not be empty");
  require(keys_.emplace(key, 0).second, Errc::invalid_argument, "key ", key, " appears twice in the state dict");
}

void StateDict::add(ShardedTensor tensor) {
  require(static_cast<std::size_t>(tensor.shape.rank()) == tensor.global_shape.size() &&
              tensor.global_offset.size() == tensor.global_shape.size(),
          Errc::invalid_argument, "tensor ", tensor.key, ": shard, global shape and offset must have the same rank");
  claim_key(tensor.key);
  tensors_.push_back(std::move(tensor));
}

void StateDict::add(ShardedParam param) {
  validate(param.spec);
  (void)plan_rank(param.spec, param.gtp, param.align, param.coord);  // rejects bad coordinates and geometry now
  claim_key(param.spec.key);
  params_.push_back(std::move(param));
}

void StateDict::add_common(std::string key, CommonValue value) {
  claim_key(key);
  common_.emplace(std::move(key), std::move(value));
}

void StateDict::add_local(std::string key, CommonValue value) {
  claim_key(key);
  local_.emplace(std::move(key), std::move(value));
}

SavePlan prepare_save(const StateDict& state) {
  SavePlan out;
  for (const ShardedTensor& t : state.tensors()) {
    require(t.data.dtype() == t.dtype && t.data.shape() == t.shape, Errc::shape_mismatch, "tensor ", t.key,
            ": the data does not match the declared dtype and shape");
    out.items.push_back(
        {t.key, t.dtype, t.global_shape, t.global_offset, t.shape.to_vector(), t.replica_id == 0, t.data});
  }
  for (const ShardedParam& p : state.params()) {
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    const Extents shape = p.shard_shape();
    require(p.shard.dtype() == p.dtype, Errc::dtype_mismatch, where(p), ": the shard is ", dtype_name(p.shard.dtype()),
            ", declared ", dtype_name(p.dtype));
    require(p.shard.shape() == shape, Errc::shape_mismatch, where(p), ": the shard has shape ",
            dims_text(p.shard.shape().dims()), " but ", p.spec.rows(), " rows over ", p.gtp, " GTP ranks at alignment ",
            p.align, " give padded shards of shape ", dims_text(shape.dims()));
    out.params.push_back(record_of(p.spec));
    if (plan.padding_only) {
      out.placeholders.push_back({p.spec.key, p.dtype, shape.with_rows(0)});
      continue;
    }
    for (const Piece& piece : plan.pieces)
      out.items.push_back({piece.key, p.dtype, piece.global_shape, piece.global_offset, piece.count,
                           plan.main_replica && p.replica_id == 0,
                           p.shard.rows(piece.shard_row, piece.shard_row + piece.rows)});
  }
  out.common = state.common();
  return out;
}

std::vector<Claim> claims_of(const SavePlan& plan, int rank) {
  std::vector<Claim> out;
  out.reserve(plan.items.size());
  for (const SaveItem& i : plan.items)
    out.push_back({i.key, i.dtype, i.global_shape, i.global_offset, i.count, rank, i.main_replica});
  return out;
}

std::vector<DatasetSpec> datasets_of(std::span<const Claim> claims) {
  std::map<std::string_view, std::vector<const Claim*>> by_key;
  for (const Claim& c : claims) by_key[c.key].push_back(&c);
  std::vector<DatasetSpec> out;
  out.reserve(by_key.size());
  for (const auto& [key, list] : by_key) {
    const Claim& c = *list.front();
    out.push_back({c.key, c.dtype, c.global_shape, std::nullopt, false, band_chunk(list)});
  }
  return out;
}

void write_items(const SavePlan& plan, std::span<const DatasetInfo> datasets, PieceWriter& writer) {
  std::map<std::string_view, const DatasetInfo*> by_key;
  for (const DatasetInfo& d : datasets) by_key.emplace(d.key, &d);
  for (const SaveItem& i : plan.items) {
    if (!i.main_replica) continue;
    const auto it = by_key.find(i.key);
    require(it != by_key.end(), Errc::missing_key, "key ", i.key, " has no dataset in the checkpoint being written");
    writer.write(*it->second, i.global_offset, i.count, i.data);
  }
}

std::vector<std::string> LoadedState::keys() const {
  std::vector<std::string> out;
  for (const auto& [key, entry] : entries_) out.push_back(key);
  return out;
}

const HostBuffer& LoadedState::tensor(std::string_view key) const {
  const auto it = entries_.find(key);
  require(it != entries_.end() && std::holds_alternative<HostBuffer>(it->second), Errc::missing_key, "no tensor ", key,
          " in the loaded state");
  return std::get<HostBuffer>(it->second);
}

HostBuffer LoadedState::take_tensor(std::string_view key) {
  (void)tensor(key);
  return std::get<HostBuffer>(std::move(entries_.find(key)->second));
}

const CommonValue& LoadedState::value(std::string_view key) const {
  const auto it = entries_.find(key);
  require(it != entries_.end() && std::holds_alternative<CommonValue>(it->second), Errc::missing_key, "no value ", key,
          " in the loaded state");
  return std::get<CommonValue>(it->second);
}

LoadedState load(const fs::path& path, const StateDict& request, LoadOptions options) {
  return load_with(path, request, options, CheckpointKind::global);
}

LoadedState load_local(const fs::path& path, const StateDict& request, LoadOptions options) {
  return load_with(path, request, options, CheckpointKind::local);
}

void save_local(const StateDict& state, const fs::path& path, IoMethod method) {
  const ForbidMaterialization no_copies;
  const SavePlan plan = prepare_save(state);
  std::vector<DatasetSpec> specs;
  for (const SaveItem& i : plan.items)
    specs.push_back({i.key, i.dtype, i.count, PiecePlacement{i.global_shape, i.global_offset}, false, {}});
  for (const Placeholder& p : plan.placeholders)
    specs.push_back({p.key, p.dtype, p.shape.to_vector(), std::nullopt, true, {}});
  const fs::path partial = partial_path(path);
  try {
    const std::vector<DatasetInfo> infos =
        create_skeleton(partial, specs, {CheckpointKind::local, plan.params, plan.common});
    PieceWriter writer(partial, method);
    for (std::size_t n = 0; n < plan.items.size(); ++n) {
      const SaveItem& i = plan.items[n];
      writer.write(infos[n], std::vector<std::int64_t>(i.count.size(), 0), i.count, i.data);
    }
    writer.finish();
    mark_complete(partial);
    commit(partial, path);
  } catch (Error& e) {
    discard(partial);
    throw std::move(e.add_context(cat("while saving the local checkpoint ", path.string())));
  }
}

}  // namespace shardckpt
