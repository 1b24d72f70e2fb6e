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
#include <tuple>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.merge.seam;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;
import shardckpt.merge;
import :pieces;

namespace shardckpt {
namespace {

// Where the slabs of a load come from, and how their bytes reach their destination: straight into
// host memory, or into device memory through the pool's pinned buffers (while the engine copies
// one buffer to the device, the next is read into another).
class Source {
 public:
  Source(const CheckpointReader& reader, bool local, const LoadOptions& options)
      : reader_(reader),
        local_(local),
        read_{options.method, options.verify_checksums, options.progress, options.bypass_page_cache} {
    if (options.staging) arena_.emplace(options.staging);
    if (local)
      for (const Dataset& d : reader.datasets())
        if (d.placement) by_box_.emplace(place(d.placement->key, d.placement->box), &d);
  }
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  // The engine may still be copying out of the pool into destinations: wait, whatever happened.
  ~Source() {
    try {
      finish();
    } catch (const Error&) {
    }
  }

  // Reads the piece's box of its dataset into its rows.
  void read(const PieceView<true>& piece, std::string_view who) {
    const std::string_view key = piece.key;
    const DType dtype = piece.dtype;
    const std::span<const std::int64_t> global_shape = piece.global_shape;
    const Box& box = piece.box;
    const MutTensorView dst = piece.rows;
    if (box.empty()) return;
    const Dataset* d = nullptr;
    Box from = box;
    if (!local_) {
      d = &reader_.dataset(key);
      check_dataset(*d, dtype, global_shape, who);
    } else {
      const auto it = by_box_.find(place(key, box));
      require(it != by_box_.end(), Errc::missing_key, "key ", key, ": the local checkpoint ", reader_.path().string(),
              " holds no piece at rows [", box.rows.begin, ", ", box.rows.end, ") and elements [", box.cols.begin, ", ",
              box.cols.end, "): it was saved at another layout (", who, ")");
      d = it->second;
      require(d->dtype == dtype && d->placement->global_shape == std::vector(global_shape.begin(), global_shape.end()),
              Errc::shape_mismatch, "key ", key, ": the local piece's dtype or global shape differ from ", who, "'s");
      from = whole_box(d->shape);
    }
    if (dst.space().host_accessible()) {
      reader_.read(*d, from, dst, read_);
      return;
    }
    arena_for(dst.space());
    for (std::int64_t r0 = 0; r0 < dst.rows();) {
      const MutTensorView staged = arena_->take(dst, dst.rows() - r0, [](int) {});
      const std::int64_t n = staged.rows();
      reader_.read(*d, {{from.rows.begin + r0, from.rows.begin + r0 + n}, from.cols}, staged, read_);
      arena_->engine().copy_to_device(staged, dst.slice_rows(r0, r0 + n));
      r0 += n;
    }
  }

  void zero(MutTensorView dst) {
    if (dst.empty()) return;
    if (dst.space().host_accessible()) {
      std::memset(dst.data(), 0, dst.bytes());
      return;
    }
    arena_for(dst.space());
    arena_->engine().zero(dst);
  }

  // Every copy to a device and every zero fill has landed (a load may have issued zero fills only).
  void finish() {
    if (!arena_) return;
    arena_->drain([](int) {});
    arena_->engine().wait(arena_->engine().fence());
  }

  bool local() const noexcept { return local_; }

 private:
  // The pool device bytes go through: the caller's (LoadOptions::staging), or the library's for the
  // device (device_staging), taken at the first device destination and held to the end of the load.
  void arena_for(MemorySpace space) {
    if (!arena_) arena_.emplace(device_staging(space));
  }

  // Where a local piece goes: its key and its box of the global dataset, compared as values.
  using Place = std::tuple<std::string_view, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  static Place place(std::string_view key, const Box& b) {
    return {key, b.rows.begin, b.rows.end, b.cols.begin, b.cols.end};
  }

  const CheckpointReader& reader_;
  bool local_;
  ReadOptions read_;
  std::optional<Arena> arena_;
  std::map<Place, const Dataset*> by_box_;  // local pieces by key and box (keys live in the reader)
};

// A tree of a load before the factory merges: each key's loaded shard (its destination, filled),
// a placeholder (a padding-only rank's parameter, from the request), or a value.
struct Placeholder {
  Extents shape;  // zero rows, the parameter's trailing dims
};
using Slot = std::variant<MutTensorView, Placeholder, CommonValue>;
using Tree = std::map<std::string, Slot, std::less<>>;

void load_tensors(Source& src, StateDict& state, bool share, Tree& tree) {
  for (std::size_t i = 0; i < state.tensors().size(); ++i) {
    const ShardedTensor& t = state.tensors()[i];
    const std::string who = cat("tensor ", t.key);
    const MutTensorView dst = load_view(state.mut_data(i), t.dtype, t.shape, who);
    tensor_pieces(t, dst, own_rows(t.shape.rows(), t.replica_id, t.replicas, share && !src.local()),
                  [&](const PieceView<true>& piece) { src.read(piece, who); });
    tree.emplace(t.key, dst);
  }
}

// Loads every sharded parameter into its destination: pieces read into their rows, pad rows zeroed.
// A padding-only rank reads nothing (its placeholder comes from the request, as a local value).
void load_params(Source& src, StateDict& state, std::span<const RankPlan> plans, bool share, Tree& tree) {
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const ShardedParam& p = state.params()[i];
    const RankPlan& plan = plans[i];
    if (plan.padding_only) continue;
    const std::string who = p.describe();
    const MutTensorView dst = load_view(state.mut_shard(i), p.dtype, p.shard_shape(), who);
    param_pieces(p, plan, dst, own_rows(plan.real_rows, p.replica_id, p.replicas, share && !src.local()),
                 [&](const PieceView<true>& piece) { src.read(piece, who); });
    if (p.flat) {  // the range's elements in pad rows
      const std::int64_t real_end = std::clamp(plan.real_rows * plan.row_elems, p.flat->begin, p.flat->end);
      src.zero(reshaped(dst, real_end - p.flat->begin, 1, p.flat->end - real_end));
    } else {
      src.zero(dst.slice_rows(plan.real_rows, dst.rows()));
    }
    tree.emplace(p.spec.key, dst);
  }
}

// The local (non-persistent) values of a load: the request's own, and for every parameter of which
// this rank holds only pad rows, the zero-row placeholder that keeps its key, dtype and trailing
// shape. Neither comes from the file.
void add_local_values(const StateDict& state, std::span<const RankPlan> plans, Tree& tree) {
  for (const auto& [key, value] : state.local()) tree.insert_or_assign(key, value);
  for (std::size_t i = 0; i < plans.size(); ++i)
    if (const ShardedParam& p = state.params()[i]; plans[i].padding_only)
      tree.insert_or_assign(p.spec.key, Placeholder{p.padded_shape().with_rows(0)});
}

// Factory merges, applied to the complete tree: a padding-only rank's placeholder becomes its
// all-zero shard (in its destination); a loaded shard is checked against the factory's shape. A
// factory whose key is missing from the tree means the loaded keys differ from the requested ones.
void merge_factories(Source& src, StateDict& state, Tree& tree) {
  for (std::size_t i = 0; i < state.params().size(); ++i) {
    const ShardedParam& p = state.params()[i];
    const auto it = tree.find(p.spec.key);
    require(it != tree.end() && !std::holds_alternative<CommonValue>(it->second), Errc::missing_key, p.describe(),
            ": nothing was loaded under its key, so the loaded keys differ from the requested ones");
    if (const auto* placeholder = std::get_if<Placeholder>(&it->second)) {
      require(placeholder->shape == p.padded_shape().with_rows(0), Errc::shape_mismatch, p.describe(),
              ": its placeholder does not have the factory's trailing shape");
      const MutTensorView dst = load_view(state.mut_shard(i), p.dtype, p.shard_shape(), p.describe());
      src.zero(dst);
      it->second = dst;
    }
    const MutTensorView& shard = std::get<MutTensorView>(it->second);
    require(shard.shape() == p.shard_shape() && shard.dtype() == p.dtype, Errc::shape_mismatch, p.describe(),
            ": the loaded shard does not have the factory's shape ", dims_text(p.shard_shape().dims()));
  }
}

// The records of the checkpoint know its model: a request at a TP that does not divide a parameter's
// heads or groups is refused before anything is read, however its sections were computed, with the
// message spec_at_tp and validate give.
void require_recorded_divisors(const CheckpointReader& reader, const StateDict& state) {
  std::map<std::string_view, const ParamRecord*> records;
  for (const ParamRecord& r : reader.contents().params) records.emplace(r.key, &r);
  for (const ShardedParam& p : std::as_const(state).params())
    if (const auto it = records.find(p.spec.key); it != records.end())
      require_tp_divides(p.spec.key, it->second->divisors, p.spec.tp);
}

}  // namespace

Values load_with(const CheckpointReader& reader, StateDict& state, const LoadOptions& options, CheckpointKind kind,
                 bool read_own_share) {
  require(options.expect_id.empty() || reader.contents().id == options.expect_id, Errc::replaced,
          reader.path().string(), " holds checkpoint ", reader.contents().id, ", not ", options.expect_id,
          ": it was replaced since it was opened");
  require(reader.contents().kind == kind, Errc::not_a_checkpoint, reader.path().string(), " is a ",
          reader.contents().kind == CheckpointKind::local ? "local (per-rank)" : "global", " checkpoint; use ",
          reader.contents().kind == CheckpointKind::local ? "load_local" : "load");
  require_recorded_divisors(reader, state);
  require_disjoint(load_targets(state), "this rank");
  std::vector<RankPlan> plans;  // each parameter planned once, in the state dict's order
  for (const ShardedParam& p : std::as_const(state).params())
    plans.push_back(plan_rank(p.spec, p.gtp, p.align, p.coord));
  Source src(reader, kind == CheckpointKind::local, options);
  Tree tree;
  load_tensors(src, state, read_own_share, tree);
  load_params(src, state, plans, read_own_share, tree);
  // The complete tree first (shards, common values, local values), then the factory merges.
  for (const auto& [key, value] : reader.contents().common) tree.emplace(key, value);
  add_local_values(state, plans, tree);
  merge_factories(src, state, tree);
  src.finish();
  Values values;
  for (auto& [key, slot] : tree)
    if (auto* v = std::get_if<CommonValue>(&slot)) values.emplace(key, std::move(*v));
  return values;
}

std::vector<LoadTarget> load_targets(StateDict& state) {
  std::vector<LoadTarget> out;
  const auto add = [&](TensorRef& ref, DType dtype, const Extents& shape, const std::string& key,
                       std::string_view who) {
    const MutTensorView dst = load_view(ref, dtype, shape, who);
    const auto begin = reinterpret_cast<std::uintptr_t>(dst.data());
    if (dst.bytes() > 0) out.push_back({key, dst.space(), begin, begin + dst.bytes()});
  };
  for (std::size_t i = 0; i < state.tensors().size(); ++i) {
    const ShardedTensor& t = state.tensors()[i];
    add(state.mut_data(i), t.dtype, t.shape, t.key, cat("tensor ", t.key));
  }
  for (std::size_t i = 0; i < state.params().size(); ++i) {
    const ShardedParam& p = state.params()[i];
    add(state.mut_shard(i), p.dtype, p.shard_shape(), p.spec.key, p.describe());
  }
  return out;
}

void require_thread_safe_hdf5(bool thread_ranks, bool thread_safe) {
  require(thread_safe || !thread_ranks, Errc::invalid_argument,
          "ranks that are threads of one process call HDF5 at the same time, and this HDF5 is not built "
          "thread-safe (H5is_library_threadsafe): run one process per rank (MPI), or link a thread-safe HDF5");
}

void require_disjoint(std::vector<LoadTarget> targets, std::string_view who) {
  std::sort(targets.begin(), targets.end(), [](const LoadTarget& a, const LoadTarget& b) {
    return a.space.kind != b.space.kind   ? a.space.kind < b.space.kind
           : a.space.device != b.space.device ? a.space.device < b.space.device
                                              : a.begin < b.begin;
  });
  for (std::size_t i = 1; i < targets.size(); ++i) {
    const LoadTarget& a = targets[i - 1];
    const LoadTarget& b = targets[i];
    require(!(a.space == b.space) || b.begin >= a.end, Errc::invalid_argument, "the destinations of ", a.key,
            " and ", b.key, " share ", std::min(a.end, b.end) - b.begin, " bytes of ", memory_space_text(a.space),
            " memory (", who, "): a load would fill one with the other's rows");
  }
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

// The host memory the destinations of `request` take, checked against what this process can have
// before any of it is allocated.
void require_memory_for(const StateDict& request) {
  std::uint64_t bytes = 0;
  const auto add = [&](const Extents& shape, DType dtype, std::string_view key) {
    bytes = static_cast<std::uint64_t>(checked_add(
        static_cast<std::int64_t>(bytes),
        checked_mul(shape.elements(), element_bytes(dtype), cat("the bytes of ", key)),
        "the bytes of a load"));
  };
  for (const ShardedTensor& t : request.tensors()) add(t.shape, t.dtype, t.key);
  for (const ShardedParam& p : request.params()) add(p.shard_shape(), p.dtype, p.spec.key);
  require_host_memory(bytes, "loading this rank's tensors");
}

namespace {

// A tensor asked for whole, counted as the materialization it is, in memory of its own or mapped.
// A scalar is whole too, but one element: not what the count is for (a gather of a tensor).
void count_whole(const ShardedTensor& t) {
  if (t.shape.dims().size() == t.global_shape.size() &&
      std::equal(t.global_shape.begin(), t.global_shape.end(), t.shape.dims().begin()))
    count_materialization(cat("loading the whole tensor ", t.key),
                          static_cast<std::size_t>(t.shape.elements()) * dtype_size(t.dtype));
}
// One GTP rank holding a parameter that TP does not split (TP 1, or replicated) holds it whole.
void count_whole(const ShardedParam& p) {
  if (!p.flat && p.gtp == 1 && (p.spec.tp == 1 || p.spec.tp_axis == TpAxis::replicated))
    count_materialization(cat("loading the whole parameter ", p.spec.key),
                          static_cast<std::size_t>(p.shard_shape().elements()) * dtype_size(p.dtype));
}

void require_once(const Allocated& out, const std::string& key) {
  require(!out.buffers.contains(key), Errc::invalid_argument, "tensor ", key,
          " appears more than once in the request: a load into new memory gives one tensor per key (load_into "
          "fills several parts of one key)");
}

// The dataset `key` when it is the dataset of `dtype` and `global_shape` that a load would read, else
// none (the load then reads it and names what is wrong).
const Dataset* dataset_as_asked(const CheckpointReader& reader, std::string_view key, DType dtype,
                                std::span<const std::int64_t> global_shape) {
  const std::vector<Dataset>& all = reader.datasets();
  const auto it = std::lower_bound(all.begin(), all.end(), key, [](const Dataset& d, std::string_view k) { return d.key < k; });
  if (it == all.end() || it->key != key || it->dtype != dtype ||
      !std::equal(it->shape.begin(), it->shape.end(), global_shape.begin(), global_shape.end()))
    return nullptr;
  return &*it;
}

// The part of a mapped tensor that a slab of whole rows of one dataset is, or none.
std::optional<MapPart> part_of(const CheckpointReader& reader, const std::string& key, DType dtype,
                               std::span<const std::int64_t> global_shape, std::span<const std::int64_t> offset,
                               std::span<const std::int64_t> count) {
  const Dataset* d = dataset_as_asked(reader, key, dtype, global_shape);
  if (!d || global_shape.empty() || splits_past_dim1(global_shape, offset, count)) return std::nullopt;
  const Box box = footprint(key, global_shape, offset, count);
  if (box.cols != whole_box(global_shape).cols) return std::nullopt;
  return MapPart{d, box};
}

// The parts of a tensor the request asks for, when it can be mapped: one slab of whole rows.
std::optional<std::vector<MapPart>> map_parts(const CheckpointReader& reader, const ShardedTensor& t) {
  const std::optional<MapPart> part = part_of(reader, t.key, t.dtype, t.global_shape, t.global_offset, t.count());
  if (!part) return std::nullopt;
  return std::vector<MapPart>{*part};
}

// A parameter's shard is runs of rows of its datasets when its pieces, in order, fill it without
// pad rows (a plain weight at TP 1, an unpadded shard, a fused weight's blocks at TP 1).
std::optional<std::vector<MapPart>> map_parts(const CheckpointReader& reader, const ShardedParam& p) {
  if (p.flat) return std::nullopt;
  const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
  if (plan.padding_only) return std::nullopt;
  std::vector<MapPart> parts;
  std::int64_t row = 0;
  for (const Piece& piece : plan.pieces) {
    if (piece.shard_row != row) return std::nullopt;
    const std::optional<MapPart> part =
        part_of(reader, piece.key, p.dtype, piece.global_shape, piece.global_offset, piece.count);
    if (!part) return std::nullopt;
    parts.push_back(*part);
    row += piece.rows;
  }
  if (row != p.shard_shape().rows()) return std::nullopt;
  return parts;
}

}  // namespace

Allocated allocate_destinations(const StateDict& request) {
  require_memory_for(request);
  Allocated out;
  for (ShardedTensor t : request.tensors()) {
    count_whole(t);
    require_once(out, t.key);
    SharedBuffer b = SharedBuffer::uninitialized(t.dtype, t.shape);
    t.data = b;
    out.buffers.emplace(t.key, std::move(b));
    out.state.add(std::move(t));
  }
  for (ShardedParam p : request.params()) {
    count_whole(p);
    SharedBuffer b = SharedBuffer::uninitialized(p.dtype, p.shard_shape());
    p.shard = b;
    out.buffers.emplace(p.spec.key, std::move(b));
    out.state.add(std::move(p));
  }
  for (const auto& [key, value] : request.local()) out.state.add_local(key, value);
  return out;
}

Allocated map_or_allocate(const CheckpointReader& reader, const StateDict& request, const LoadOptions& options,
                          bool shared_too) {
  if (!options.map || reader.contents().kind != CheckpointKind::global ||
      (!options.expect_id.empty() && reader.contents().id != options.expect_id))
    return allocate_destinations(request);  // the load refuses the last two itself
  const ReadOptions read{options.method, options.verify_checksums, options.progress, options.bypass_page_cache};
  // Every tensor that can be mapped, mapped in one batch (CheckpointReader::map_all: its pages
  // brought in in file order, its rows checked behind them); the others read into memory of their own.
  struct Candidate {
    const ShardedTensor* tensor = nullptr;
    const ShardedParam* param = nullptr;
    std::vector<MapPart> parts;
  };
  std::vector<Candidate> candidates;
  std::set<std::string, std::less<>> asked;
  for (const ShardedTensor& t : request.tensors()) {
    std::optional<std::vector<MapPart>> parts;
    if ((shared_too || t.replicas <= 1) && !asked.contains(t.key)) parts = map_parts(reader, t);
    if (parts) asked.insert(t.key);
    candidates.push_back({&t, nullptr, parts ? std::move(*parts) : std::vector<MapPart>{}});
  }
  for (const ShardedParam& p : request.params()) {
    std::optional<std::vector<MapPart>> parts;
    if (shared_too || p.replicas <= 1) parts = map_parts(reader, p);
    candidates.push_back({nullptr, &p, parts ? std::move(*parts) : std::vector<MapPart>{}});
  }
  std::vector<MapRequest> batch;
  for (const Candidate& c : candidates)
    batch.push_back(c.tensor ? MapRequest{c.parts, c.tensor->dtype, c.tensor->shape}
                             : MapRequest{c.parts, c.param->dtype, c.param->shard_shape()});
  std::vector<std::optional<SharedBuffer>> mapped = reader.map_all(batch, read);
  std::map<std::string, SharedBuffer, std::less<>> maps;
  StateDict rest;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (c.tensor) {
      if (!mapped[i]) {
        rest.add(ShardedTensor(*c.tensor));
        continue;
      }
      count_whole(*c.tensor);
      maps.emplace(c.tensor->key, std::move(*mapped[i]));
    } else {
      if (!mapped[i]) {
        rest.add(ShardedParam(*c.param));
        continue;
      }
      count_whole(*c.param);
      maps.emplace(c.param->spec.key, std::move(*mapped[i]));
    }
  }
  for (const auto& [key, value] : request.local()) rest.add_local(key, value);
  Allocated out = allocate_destinations(rest);
  for (auto& [key, b] : maps) {
    require_once(out, key);
    out.buffers.emplace(key, std::move(b));
  }
  return out;
}

LoadedState load_new(const CheckpointReader& reader, const StateDict& request, const LoadOptions& options) {
  Allocated a = map_or_allocate(reader, request, options, true);
  Values values = load_with(reader, a.state, options, CheckpointKind::global);
  return LoadedState(std::move(a.buffers), std::move(values));
}

std::vector<ReplicaRows> replica_rows(StateDict& state) {
  std::vector<ReplicaRows> out;
  const auto counts = [](std::int64_t rows, int replicas) {
    std::vector<std::int64_t> c;
    for (int i = 0; i < replicas; ++i) c.push_back(balanced_share(rows, replicas, i).size());
    return c;
  };
  for (std::size_t i = 0; i < state.tensors().size(); ++i)
    if (const ShardedTensor& t = state.tensors()[i]; t.replicas > 1)
      out.push_back({state.mut_data(i).mut_view(), counts(t.shape.rows(), t.replicas)});
  for (std::size_t i = 0; i < state.params().size(); ++i) {
    const ShardedParam& p = state.params()[i];
    if (p.replicas <= 1 || p.flat) continue;
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    if (!plan.padding_only)
      out.push_back({state.mut_shard(i).mut_view().slice_rows(0, plan.real_rows), counts(plan.real_rows, p.replicas)});
  }
  return out;
}

}  // namespace shardckpt
