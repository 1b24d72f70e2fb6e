module;
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.state;
import shardckpt.io;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using Tree = std::map<std::string, LoadedState::Entry, std::less<>>;

std::string where(const ShardedParam& p) {
  return cat("parameter ", p.spec.key, " (TP rank ", p.coord.tp_rank, ", GTP rank ", p.coord.gtp_rank, ")");
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
  ReadOptions options;

  void read(std::string_view key, DType dtype, std::span<const std::int64_t> global_shape,
            std::span<const std::int64_t> global_offset, std::span<const std::int64_t> count, MutTensorView dst,
            std::string_view who) const {
    const DatasetInfo& d = reader.dataset(key);
    if (!local) {
      check_dataset(d, dtype, global_shape, who);
      reader.read(d, global_offset, count, dst, options);
      return;
    }
    check_dataset(d, dtype, count, who);
    const PiecePlacement want{{global_shape.begin(), global_shape.end()}, {global_offset.begin(), global_offset.end()}};
    require(d.placement == want, Errc::shape_mismatch, "key ", key, ": the local checkpoint ", reader.path().string(),
            " was saved at another layout (", who, " expects offset ", dims_text(global_offset), ")");
    const std::vector<std::int64_t> zero(count.size(), 0);
    reader.read(d, zero, count, dst, options);
  }
};

// Loads every sharded entry of the request into the tree: plain shards as new buffers, factories as
// their padded shard (pieces read into its rows, pad rows zeroed). A padding-only rank reads nothing.
void load_shards(const Source& src, const StateDict& request, Tree& tree) {
  for (const ShardedTensor& t : request.tensors()) {
    HostBuffer buf = HostBuffer::uninitialized(t.dtype, t.shape);
    src.read(t.key, t.dtype, t.global_shape, t.global_offset, t.shape.dims(), buf.mut_view(), cat("tensor ", t.key));
    tree.emplace(t.key, std::move(buf));
  }
  for (const ShardedParam& p : request.params()) {
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    if (plan.padding_only) continue;
    const Extents shape = p.shard_shape();
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

// The local (non-persistent) values of a load: the request's own, and for every parameter of which
// this rank holds only pad rows, the zero-row placeholder that keeps its key, dtype and trailing
// shape. Neither comes from the file.
void add_local_values(const StateDict& request, Tree& tree) {
  for (const auto& [key, value] : request.local()) tree.insert_or_assign(key, value);
  for (const ShardedParam& p : request.params())
    if (plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only)
      tree.insert_or_assign(p.spec.key, HostBuffer::zeros(p.dtype, p.shard_shape().with_rows(0)));
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

LoadedState load_with(const CheckpointReader& reader, const StateDict& request, const LoadOptions& options,
                      CheckpointKind kind) {
  require(options.expect_id.empty() || reader.contents().id == options.expect_id, Errc::replaced,
          reader.path().string(), " holds checkpoint ", reader.contents().id, ", not ", options.expect_id,
          ": it was replaced since it was opened");
  require(reader.contents().kind == kind, Errc::not_a_checkpoint, reader.path().string(), " is a ",
          reader.contents().kind == CheckpointKind::local ? "local (per-rank)" : "global", " checkpoint; use ",
          reader.contents().kind == CheckpointKind::local ? "load_local" : "load");
  Tree tree;
  load_shards(Source{reader, kind == CheckpointKind::local, {options.method, options.verify_checksums, options.progress}},
              request, tree);
  // The complete tree first (shards, common values, local values), then the factory merges.
  for (const auto& [key, value] : reader.contents().common) tree.emplace(key, value);
  add_local_values(request, tree);
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

void notice_unchecked(const CheckpointReader& reader, const LoadOptions& options) {
  std::string line;
  if (reader.version() < 2)
    line = cat(reader.path().string(), " was written before checksums existed (format version ", reader.version(),
               "): its bytes are loaded unchecked");
  else if (options.verify_checksums && !reader.checksummed())
    line = cat(reader.path().string(), " was saved without checksums: its bytes are loaded unchecked");
  else if (!reader.seal())
    line = cat(reader.path().string(), " has no seal (another tool changed it after the save): its HDF5 metadata is ",
               "read unchecked");
  if (line.empty()) return;
  if (options.notice)
    options.notice(line);
  else
    std::cerr << "shardckpt: notice: " << line << "\n";
}

LoadedState load(const CheckpointReader& reader, const StateDict& request, LoadOptions options) {
  return load_with(reader, request, options, CheckpointKind::global);
}

LoadedState load(const fs::path& path, const StateDict& request, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_with(reader, request, options, CheckpointKind::global);
}

LoadedState load_local(const fs::path& path, const StateDict& request, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_with(reader, request, options, CheckpointKind::local);
}

StateDict request_all(const CheckpointReader& reader, const LoadLayout& layout) {
  StateDict out;
  std::set<std::string, std::less<>> covered;
  const auto add = [&](const ParamRecord& record, DType dtype) {
    out.add(ShardedParam{spec_at_tp(record, layout.tp), layout.gtp, layout.align, layout.coord, dtype,
                         layout.replica_id, {}});
  };
  for (const ParamRecord& r : reader.params()) {
    for (const Section& b : r.blocks) covered.insert(block_key(r.key, b.name));
    add(r, reader.dataset(block_key(r.key, r.blocks.front().name)).dtype);
  }
  for (const DatasetInfo& d : reader.datasets())
    if (!covered.contains(d.key) && d.shape[0] > 0)
      add({d.key, TpAxis::replicated, plain_sections(d.shape[0]), {d.shape.begin() + 1, d.shape.end()}}, d.dtype);
  return out;
}

void save_local(const StateDict& state, const fs::path& path, IoMethod method) {
  const ForbidMaterialization no_copies;
  const SavePlan plan = prepare_save(state);
  std::vector<DatasetSpec> specs;
  std::int64_t units = 0;
  for (const SaveItem& i : plan.items) {
    const Box whole = whole_box(i.count);
    specs.push_back({i.key, i.dtype, i.count, PiecePlacement{i.global_shape, i.global_offset}, {}, {}});
    if (!whole.empty()) specs.back().slabs.push_back({whole, units});
    units += units_of(whole);
  }
  const fs::path target = io::follow_links(path);
  const fs::path partial = partial_path(target);
  try {
    const Skeleton skeleton =
        create_skeleton(partial, specs, {CheckpointKind::local, plan.params, plan.common, io::random_id()}, units);
    PieceWriter writer(partial, method, ChecksumSlot{skeleton.checksums_address, 0});
    for (std::size_t n = 0; n < plan.items.size(); ++n)
      writer.write(skeleton.datasets[n], whole_box(plan.items[n].count), plan.items[n].data);
    writer.finish();
    mark_complete(partial, skeleton.data);
    commit(partial, target);
  } catch (Error& e) {
    discard(partial);
    throw std::move(e.add_context(cat("while saving the local checkpoint ", path.string())));
  }
}

}  // namespace shardckpt
