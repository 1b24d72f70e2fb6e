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
import shardckpt.storage;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;

std::string where(const ShardedParam& p) {
  return cat("parameter ", p.spec.key, " (TP rank ", p.coord.tp_rank, ", GTP rank ", p.coord.gtp_rank, ")");
}

// Elements [offset, offset + rows * cols) of a 1-D view, seen as `rows` rows of `cols`.
template <bool Mutable>
BasicView<Mutable> reshaped(BasicView<Mutable> flat, std::int64_t offset, std::int64_t rows, std::int64_t cols) {
  require(offset >= 0 && rows * cols <= flat.shape().elements() - offset, Errc::internal, "a flat part past its range");
  return BasicView<Mutable>::borrow(flat.data() + offset * element_bytes(flat.dtype()), flat.dtype(), {rows, cols},
                                    flat.space());
}

// Checks that the checkpoint's dataset can serve a slab of `dtype` at `global_shape`.
void check_dataset(const Dataset& d, DType dtype, std::span<const std::int64_t> global_shape,
                   std::string_view who) {
  require(d.dtype == dtype, Errc::dtype_mismatch, "key ", d.key, ": the checkpoint holds ", dtype_name(d.dtype),
          " but ", who, " asks for ", dtype_name(dtype));
  require(std::equal(d.shape.begin(), d.shape.end(), global_shape.begin(), global_shape.end()), Errc::shape_mismatch,
          "key ", d.key, ": the checkpoint holds global shape ", dims_text(d.shape), " but ", who, " expects ",
          dims_text(global_shape));
}

// The destination of an entry must be there, of its dtype and shape, and writable.
MutTensorView destination(const TensorRef& ref, DType dtype, const Extents& shape, std::string_view who) {
  require(static_cast<bool>(ref), Errc::invalid_argument, who, ": the request has no destination to load into");
  require(ref.dtype() == dtype && ref.shape() == shape, Errc::shape_mismatch, who, ": the destination is ",
          dtype_name(ref.dtype()), " ", dims_text(ref.shape().dims()), ", not ", dtype_name(dtype), " ",
          dims_text(shape.dims()));
  return ref.mut_view();
}

// The pool's buffers, used in turn as arenas: the rows of many pieces packed into one buffer, one
// fence per buffer. Before a buffer is reused, the engine has finished the work enqueued while it
// was current (and `before_reuse` has dealt with its rows), so copying into or out of one buffer
// overlaps with reading or writing another.
class Arena {
 public:
  explicit Arena(const StagingPool& pool) : pool_(pool), fences_(static_cast<std::size_t>(pool.buffers())) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  CopyEngine& engine() const { return pool_.engine(); }
  int current() const noexcept { return current_; }

  // Room for up to `rows` rows shaped like `like`: as many as fit in the current buffer, or, when not
  // one more fits, in the next one.
  template <class BeforeReuse>
  MutTensorView take(TensorView like, std::int64_t rows, BeforeReuse&& before_reuse) {
    const std::size_t row = std::max<std::size_t>(like.row_bytes(), 1);
    (void)pool_.rows_per_buffer(like);  // a row larger than a buffer is an error
    if (aligned(used_) + row > pool_.buffer_bytes()) {
      fences_[static_cast<std::size_t>(current_)] = engine().fence();
      current_ = (current_ + 1) % pool_.buffers();
      retire(current_, before_reuse);
      used_ = 0;
    }
    const std::size_t at = aligned(used_);
    const auto fit = std::min<std::int64_t>(rows, static_cast<std::int64_t>((pool_.buffer_bytes() - at) / row));
    used_ = at + static_cast<std::size_t>(fit) * row;
    return MutTensorView::borrow(pool_.buffer(current_).data() + at, like.dtype(), like.shape().with_rows(fit),
                                 MemorySpace::pinned());
  }

  // Waits for every buffer's work, oldest first, calling before_reuse on each that was used.
  template <class BeforeReuse>
  void drain(BeforeReuse&& before_reuse) {
    if (used_ > 0) fences_[static_cast<std::size_t>(current_)] = engine().fence();
    for (int i = 1; i <= pool_.buffers(); ++i) retire((current_ + i) % pool_.buffers(), before_reuse);
    used_ = 0;
  }

 private:
  // Pieces start at multiples of 4 KiB: reads around the page cache land straight in them.
  static std::size_t aligned(std::size_t n) { return (n + 4095) / 4096 * 4096; }
  template <class BeforeReuse>
  void retire(int buffer, BeforeReuse&& before_reuse) {
    auto& fence = fences_[static_cast<std::size_t>(buffer)];
    if (!fence) return;
    engine().wait(*std::exchange(fence, std::nullopt));
    before_reuse(buffer);
  }

  const StagingPool& pool_;
  std::vector<std::optional<Fence>> fences_;
  int current_ = 0;
  std::size_t used_ = 0;
};

// Where the slabs of a load come from, and how their bytes reach their destination: straight into
// host memory, or into device memory through the pool's pinned buffers (while the engine copies
// one buffer to the device, the next is read into another).
class Source {
 public:
  Source(const CheckpointReader& reader, bool local, const LoadOptions& options)
      : reader_(reader),
        local_(local),
        read_{options.method, options.verify_checksums, options.progress, options.bypass_page_cache} {
    if (options.staging) arena_.emplace(*options.staging);
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

  // Reads `box` of the dataset `key` (global shape `global_shape`) into `dst`.
  void read(const std::string& key, DType dtype, std::span<const std::int64_t> global_shape, const Box& box,
            MutTensorView dst, std::string_view who) {
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
    require(arena_.has_value(), Errc::invalid_argument, who, ": loading into ", memory_space_text(dst.space()),
            " memory needs LoadOptions::staging (a pool of pinned buffers of its CopyEngine)");
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
    require(arena_.has_value(), Errc::invalid_argument, "zeroing ", memory_space_text(dst.space()),
            " memory needs LoadOptions::staging");
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
  static std::string place(std::string_view key, const Box& b) {
    return cat(key, " ", b.rows.begin, " ", b.rows.end, " ", b.cols.begin, " ", b.cols.end);
  }

  const CheckpointReader& reader_;
  bool local_;
  ReadOptions read_;
  std::optional<Arena> arena_;
  std::map<std::string, const Dataset*, std::less<>> by_box_;  // local pieces by key and box
};

// A tree of a load before the factory merges: each key's loaded shard (its destination, filled),
// a placeholder (a padding-only rank's parameter, from the request), or a value.
struct Placeholder {
  Extents shape;  // zero rows, the parameter's trailing dims
};
using Slot = std::variant<MutTensorView, Placeholder, CommonValue>;
using Tree = std::map<std::string, Slot, std::less<>>;

// Rows [begin, end) of a shard's real rows that this copy reads (all, unless it shares).
Range own_rows(std::int64_t rows, int replica_id, int replicas, bool share) {
  return share && replicas > 1 ? balanced_share(rows, replicas, replica_id) : Range{0, rows};
}

void load_tensors(Source& src, const StateDict& state, const LoadOptions& options, Tree& tree) {
  for (const ShardedTensor& t : state.tensors()) {
    const std::string who = cat("tensor ", t.key);
    const MutTensorView dst = destination(t.data, t.dtype, t.shape, who);
    const Box box = footprint(t.key, t.global_shape, t.global_offset, t.shape.dims());
    const Range mine = own_rows(t.shape.rows(), t.replica_id, t.replicas, options.read_own_share && !src.local());
    src.read(t.key, t.dtype, t.global_shape, {{box.rows.begin + mine.begin, box.rows.begin + mine.end}, box.cols},
             dst.slice_rows(mine.begin, mine.end), who);
    tree.emplace(t.key, dst);
  }
}

// Loads every sharded parameter into its destination: pieces read into their rows, pad rows zeroed.
// A padding-only rank reads nothing (its placeholder comes from the request, as a local value).
void load_params(Source& src, const StateDict& state, const LoadOptions& options, Tree& tree) {
  for (const ShardedParam& p : state.params()) {
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    if (plan.padding_only) continue;
    const MutTensorView dst = destination(p.shard, p.dtype, p.shard_shape(), where(p));
    const std::int64_t c = plan.row_elems;
    if (p.flat) {
      for (const Piece& piece : plan.pieces)
        for (const FlatPart& part : flat_parts(piece, c, {p.flat->begin, p.flat->end}))
          src.read(piece.key, p.dtype, piece.global_shape, part.box,
                   reshaped(dst, part.range_offset, part.box.rows.size(), part.box.cols.size()), where(p));
      // The range's elements in pad rows.
      const std::int64_t real_end = std::clamp(plan.real_rows * c, p.flat->begin, p.flat->end);
      src.zero(reshaped(dst, real_end - p.flat->begin, 1, p.flat->end - real_end));
      tree.emplace(p.spec.key, dst);
      continue;
    }
    const Range mine = own_rows(plan.real_rows, p.replica_id, p.replicas, options.read_own_share && !src.local());
    for (const Piece& piece : plan.pieces) {
      const Range rows = Range{piece.shard_row, piece.shard_row + piece.rows}.intersect(mine);
      if (rows.empty()) continue;
      const Box box = footprint(piece.key, piece.global_shape, piece.global_offset, piece.count);
      const std::int64_t first = box.rows.begin + rows.begin - piece.shard_row;
      src.read(piece.key, p.dtype, piece.global_shape, {{first, first + rows.size()}, box.cols},
               dst.slice_rows(rows.begin, rows.end), where(p));
    }
    src.zero(dst.slice_rows(plan.real_rows, dst.rows()));
    tree.emplace(p.spec.key, dst);
  }
}

// The local (non-persistent) values of a load: the request's own, and for every parameter of which
// this rank holds only pad rows, the zero-row placeholder that keeps its key, dtype and trailing
// shape. Neither comes from the file.
void add_local_values(const StateDict& state, Tree& tree) {
  for (const auto& [key, value] : state.local()) tree.insert_or_assign(key, value);
  for (const ShardedParam& p : state.params())
    if (plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only)
      tree.insert_or_assign(p.spec.key, Placeholder{p.padded_shape().with_rows(0)});
}

// Factory merges, applied to the complete tree: a padding-only rank's placeholder becomes its
// all-zero shard (in its destination); a loaded shard is checked against the factory's shape. A
// factory whose key is missing from the tree means the loaded keys differ from the requested ones.
void merge_factories(Source& src, const StateDict& state, Tree& tree) {
  for (const ShardedParam& p : state.params()) {
    const auto it = tree.find(p.spec.key);
    require(it != tree.end() && !std::holds_alternative<CommonValue>(it->second), Errc::missing_key, where(p),
            ": nothing was loaded under its key, so the loaded keys differ from the requested ones");
    if (const auto* placeholder = std::get_if<Placeholder>(&it->second)) {
      require(placeholder->shape == p.padded_shape().with_rows(0), Errc::shape_mismatch, where(p),
              ": its placeholder does not have the factory's trailing shape");
      const MutTensorView dst = destination(p.shard, p.dtype, p.shard_shape(), where(p));
      src.zero(dst);
      it->second = dst;
    }
    const MutTensorView& shard = std::get<MutTensorView>(it->second);
    require(shard.shape() == p.shard_shape() && shard.dtype() == p.dtype, Errc::shape_mismatch, where(p),
            ": the loaded shard does not have the factory's shape ", dims_text(p.shard_shape().dims()));
  }
}

Values load_with(const CheckpointReader& reader, const StateDict& state, const LoadOptions& options,
                 CheckpointKind kind) {
  require(options.expect_id.empty() || reader.contents().id == options.expect_id, Errc::replaced,
          reader.path().string(), " holds checkpoint ", reader.contents().id, ", not ", options.expect_id,
          ": it was replaced since it was opened");
  require(reader.contents().kind == kind, Errc::not_a_checkpoint, reader.path().string(), " is a ",
          reader.contents().kind == CheckpointKind::local ? "local (per-rank)" : "global", " checkpoint; use ",
          reader.contents().kind == CheckpointKind::local ? "load_local" : "load");
  Source src(reader, kind == CheckpointKind::local, options);
  Tree tree;
  load_tensors(src, state, options, tree);
  load_params(src, state, options, tree);
  // The complete tree first (shards, common values, local values), then the factory merges.
  for (const auto& [key, value] : reader.contents().common) tree.emplace(key, value);
  add_local_values(state, tree);
  merge_factories(src, state, tree);
  src.finish();
  Values values;
  for (auto& [key, slot] : tree)
    if (auto* v = std::get_if<CommonValue>(&slot)) values.emplace(key, std::move(*v));
  return values;
}

SavePlan plan_save(const StateDict& state, bool share_replicas);

}  // namespace

ShardedTensor ShardedTensor::of(std::string key, TensorRef data, std::vector<std::int64_t> global_shape,
                                std::vector<std::int64_t> global_offset, int replica_id, int replicas) {
  const DType dtype = data.dtype();
  const Extents shape = data.shape();
  return {std::move(key),           dtype,      shape,    std::move(global_shape),
          std::move(global_offset), replica_id, replicas, std::move(data)};
}

ShardedTensor ShardedTensor::expect(std::string key, DType dtype, Extents shape, std::vector<std::int64_t> global_shape,
                                    std::vector<std::int64_t> global_offset, int replica_id, int replicas) {
  return {std::move(key), dtype, shape, std::move(global_shape), std::move(global_offset), replica_id, replicas, {}};
}

Extents ShardedParam::padded_shape() const {
  std::vector<std::int64_t> dims{geometry().shard_rows()};
  dims.insert(dims.end(), spec.trailing.begin(), spec.trailing.end());
  return Extents(std::span<const std::int64_t>(dims));
}

Extents ShardedParam::shard_shape() const {
  if (!flat) return padded_shape();
  return {flat->end - flat->begin};
}

Range distributed_range(const ShardedParam& param, int rank, int ranks) {
  const Range r = balanced_share(param.padded_shape().elements(), ranks, rank);
  return {r.begin, r.end};
}

ShardedParam optimizer_state(const ShardedParam& param, std::string_view name, DType dtype) {
  ShardedParam out = param;
  out.spec.key = cat(optimizer_state_prefix, name, ".", param.spec.key);
  out.dtype = dtype;
  out.shard = {};
  return out;
}

void StateDict::claim_key(const std::string& key) {
  require(!key.empty(), Errc::invalid_argument, "a state dict key must not be empty");
  require(keys_.emplace(key, 0).second, Errc::invalid_argument, "key ", key, " appears twice in the state dict");
}

void StateDict::add(ShardedTensor tensor) {
  require(static_cast<std::size_t>(tensor.shape.rank()) == tensor.global_shape.size() &&
              tensor.global_offset.size() == tensor.global_shape.size(),
          Errc::invalid_argument, "tensor ", tensor.key, ": shard, global shape and offset must have the same rank");
  require(tensor.replicas >= 1 && tensor.replica_id >= 0 && tensor.replica_id < tensor.replicas, Errc::invalid_argument,
          "tensor ", tensor.key, ": replica ", tensor.replica_id, " of ", tensor.replicas);
  claim_key(tensor.key);
  tensors_.push_back(std::move(tensor));
}

void StateDict::add(ShardedParam param) {
  validate(param.spec);
  (void)plan_rank(param.spec, param.gtp, param.align, param.coord);  // rejects bad coordinates and geometry now
  require(param.replicas >= 1 && param.replica_id >= 0 && param.replica_id < param.replicas, Errc::invalid_argument,
          where(param), ": replica ", param.replica_id, " of ", param.replicas);
  if (param.flat)
    require(param.flat->begin >= 0 && param.flat->begin <= param.flat->end &&
                param.flat->end <= param.padded_shape().elements(),
            Errc::invalid_argument, where(param), ": flat range [", param.flat->begin, ", ", param.flat->end,
            ") is outside its shard of ", param.padded_shape().elements(), " elements");
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

namespace {

void add_tensor_items(const ShardedTensor& t, bool share, SavePlan& out) {
  require(static_cast<bool>(t.data), Errc::invalid_argument, "tensor ", t.key, ": no data to save");
  require(t.data.dtype() == t.dtype && t.data.shape() == t.shape, Errc::shape_mismatch, "tensor ", t.key,
          ": the data does not match the declared dtype and shape");
  const Box box = footprint(t.key, t.global_shape, t.global_offset, t.shape.dims());
  const Range mine = own_rows(t.shape.rows(), t.replica_id, t.replicas, share);
  out.items.push_back({t.key, t.dtype, t.global_shape,
                       Box{{box.rows.begin + mine.begin, box.rows.begin + mine.end}, box.cols}, true,
                       t.data.view().slice_rows(mine.begin, mine.end)});
}

void add_param_items(const ShardedParam& p, bool share, SavePlan& out) {
  const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
  require(static_cast<bool>(p.shard), Errc::invalid_argument, where(p), ": no shard to save");
  const TensorView shard = p.shard.view();
  require(shard.dtype() == p.dtype, Errc::dtype_mismatch, where(p), ": the shard is ", dtype_name(shard.dtype()),
          ", declared ", dtype_name(p.dtype));
  require(shard.shape() == p.shard_shape(), Errc::shape_mismatch, where(p), ": the shard has shape ",
          dims_text(shard.shape().dims()), " but ", p.spec.rows(), " rows over ", p.gtp, " GTP ranks at alignment ",
          p.align, p.flat ? cat(" and flat range [", p.flat->begin, ", ", p.flat->end, ")") : std::string(),
          " give shards of shape ", dims_text(p.shard_shape().dims()));
  out.params.push_back(record_of(p.spec));
  if (p.flat) {
    for (const Piece& piece : plan.pieces)
      for (const FlatPart& part : flat_parts(piece, plan.row_elems, {p.flat->begin, p.flat->end}))
        out.items.push_back({piece.key, p.dtype, piece.global_shape, part.box, plan.main_replica,
                             reshaped(shard, part.range_offset, part.box.rows.size(), part.box.cols.size())});
    return;
  }
  const Range mine = own_rows(plan.real_rows, p.replica_id, p.replicas, share);
  for (const Piece& piece : plan.pieces) {
    const Range rows = Range{piece.shard_row, piece.shard_row + piece.rows}.intersect(mine);
    if (rows.empty()) continue;
    const Box box = footprint(piece.key, piece.global_shape, piece.global_offset, piece.count);
    const std::int64_t first = box.rows.begin + rows.begin - piece.shard_row;
    out.items.push_back({piece.key, p.dtype, piece.global_shape, Box{{first, first + rows.size()}, box.cols},
                         plan.main_replica, shard.slice_rows(rows.begin, rows.end)});
  }
}

SavePlan plan_save(const StateDict& state, bool share_replicas) {
  SavePlan out;
  for (const ShardedTensor& t : state.tensors()) add_tensor_items(t, share_replicas, out);
  for (const ShardedParam& p : state.params()) add_param_items(p, share_replicas, out);
  out.common = state.common();
  return out;
}

}  // namespace

SavePlan prepare_save(const StateDict& state) { return plan_save(state, true); }

std::vector<Claim> claims_of(const SavePlan& plan, int rank) {
  std::vector<Claim> out;
  out.reserve(plan.items.size());
  for (const SaveItem& i : plan.items) out.push_back({i.key, i.dtype, i.global_shape, i.box, rank, i.writes});
  return out;
}

void write_items(const SavePlan& plan, std::span<const Dataset> datasets, PieceWriter& writer,
                 const StagingPool* staging) {
  std::map<std::string_view, const Dataset*> by_key;
  for (const Dataset& d : datasets) by_key.emplace(d.key, &d);
  // Rows of device items staged in the pool, per buffer, in write order: a buffer's rows are written
  // once the engine has copied them, while it copies into the next buffer.
  struct Staged {
    const Dataset* dataset;
    Box box;
    MutTensorView rows;
  };
  std::optional<Arena> arena;
  std::vector<std::vector<Staged>> staged(staging ? static_cast<std::size_t>(staging->buffers()) : 0);
  const auto write_buffer = [&](int b) {
    for (const Staged& s : staged[static_cast<std::size_t>(b)]) writer.write(*s.dataset, s.box, s.rows);
    staged[static_cast<std::size_t>(b)].clear();
  };
  for (const SaveItem& i : plan.items) {
    if (!i.writes) continue;
    const auto it = by_key.find(i.key);
    require(it != by_key.end(), Errc::missing_key, "key ", i.key, " has no dataset in the checkpoint being written");
    if (i.data.space().host_accessible()) {
      if (arena) arena->drain(write_buffer);  // the file gets the items in order
      writer.write(*it->second, i.box, i.data);
      continue;
    }
    require(staging != nullptr, Errc::invalid_argument, "key ", i.key, ": saving ", memory_space_text(i.data.space()),
            " memory needs a Saver with a CopyEngine (its pool of pinned buffers)");
    if (!arena) arena.emplace(*staging);
    for (std::int64_t r0 = 0; r0 < i.data.rows();) {
      const MutTensorView rows = arena->take(i.data, i.data.rows() - r0, write_buffer);
      arena->engine().copy_to_host(i.data.slice_rows(r0, r0 + rows.rows()), rows);
      staged[static_cast<std::size_t>(arena->current())].push_back(
          {it->second, {{i.box.rows.begin + r0, i.box.rows.begin + r0 + rows.rows()}, i.box.cols}, rows});
      r0 += rows.rows();
    }
  }
  if (arena) arena->drain(write_buffer);
}

std::vector<std::string> LoadedState::keys() const {
  std::vector<std::string> out;
  for (const auto& [key, t] : tensors_) out.push_back(key);
  for (const auto& [key, v] : values_) out.push_back(key);
  std::sort(out.begin(), out.end());
  return out;
}

const SharedBuffer& LoadedState::tensor(std::string_view key) const {
  const auto it = tensors_.find(key);
  require(it != tensors_.end(), Errc::missing_key, "no tensor ", key, " in the loaded state");
  return it->second;
}

const CommonValue& LoadedState::value(std::string_view key) const {
  const auto it = values_.find(key);
  require(it != values_.end(), Errc::missing_key, "no value ", key, " in the loaded state");
  return it->second;
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

Values load_into(const CheckpointReader& reader, const StateDict& state, LoadOptions options) {
  return load_with(reader, state, options, CheckpointKind::global);
}

Values load_into(const fs::path& path, const StateDict& state, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_with(reader, state, options, CheckpointKind::global);
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

Allocated allocate_destinations(const StateDict& request) {
  require_memory_for(request);
  Allocated out;
  for (ShardedTensor t : request.tensors()) {
    if (t.shape.dims().size() == t.global_shape.size() &&
        std::equal(t.global_shape.begin(), t.global_shape.end(), t.shape.dims().begin()))
      count_materialization(cat("loading the whole tensor ", t.key),
                            static_cast<std::size_t>(t.shape.elements()) * dtype_size(t.dtype));
    SharedBuffer b = SharedBuffer::uninitialized(t.dtype, t.shape);
    t.data = b;
    out.buffers.emplace(t.key, std::move(b));
    out.state.add(std::move(t));
  }
  for (ShardedParam p : request.params()) {
    // One GTP rank holding a parameter that TP does not split (TP 1, or replicated) holds it whole.
    if (!p.flat && p.gtp == 1 && (p.spec.tp == 1 || p.spec.tp_axis == TpAxis::replicated))
      count_materialization(cat("loading the whole parameter ", p.spec.key),
                            static_cast<std::size_t>(p.shard_shape().elements()) * dtype_size(p.dtype));
    SharedBuffer b = SharedBuffer::uninitialized(p.dtype, p.shard_shape());
    p.shard = b;
    out.buffers.emplace(p.spec.key, std::move(b));
    out.state.add(std::move(p));
  }
  for (const auto& [key, value] : request.local()) out.state.add_local(key, value);
  return out;
}

LoadedState load(const CheckpointReader& reader, const StateDict& request, LoadOptions options) {
  Allocated a = allocate_destinations(request);
  Values values = load_into(reader, a.state, options);
  return LoadedState(std::move(a.buffers), std::move(values));
}

LoadedState load(const fs::path& path, const StateDict& request, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load(reader, request, options);
}

std::vector<ReplicaRows> replica_rows(const StateDict& state) {
  std::vector<ReplicaRows> out;
  const auto counts = [](std::int64_t rows, int replicas) {
    std::vector<std::int64_t> c;
    for (int i = 0; i < replicas; ++i) c.push_back(balanced_share(rows, replicas, i).size());
    return c;
  };
  for (const ShardedTensor& t : state.tensors())
    if (t.replicas > 1) out.push_back({t.data.mut_view(), counts(t.shape.rows(), t.replicas)});
  for (const ShardedParam& p : state.params()) {
    if (p.replicas <= 1 || p.flat) continue;
    const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
    if (!plan.padding_only)
      out.push_back({p.shard.mut_view().slice_rows(0, plan.real_rows), counts(plan.real_rows, p.replicas)});
  }
  return out;
}

StateDict request_all(const CheckpointReader& reader, const LoadLayout& layout) {
  StateDict out;
  std::set<std::string, std::less<>> covered;
  const auto add = [&](const ParamRecord& record, DType dtype) {
    ShardedParam p{spec_at_tp(record, layout.tp), layout.gtp, layout.align, layout.coord, dtype};
    if (layout.distributed_optimizer && record.key.starts_with(optimizer_state_prefix)) {
      p.flat = distributed_range(p, layout.replica_id, layout.replicas);
    } else {
      p.replica_id = layout.replica_id;
      p.replicas = layout.replicas;
    }
    out.add(std::move(p));
  };
  for (const ParamRecord& r : reader.params()) {
    for (const Section& b : r.blocks) covered.insert(block_key(r.key, b.name));
    add(r, reader.dataset(block_key(r.key, r.blocks.front().name)).dtype);
  }
  for (const Dataset& d : reader.datasets())
    if (!covered.contains(d.key) && d.shape[0] > 0)
      add({d.key, TpAxis::replicated, plain_sections(d.shape[0]), {d.shape.begin() + 1, d.shape.end()}}, d.dtype);
  return out;
}

void save_local(const StateDict& state, const fs::path& path, IoMethod method) {
  const ForbidMaterialization no_copies;
  // A rank's own file holds all it has: replicas do not share the writing.
  const SavePlan plan = plan_save(state, false);
  std::vector<Dataset> specs;
  std::map<std::string, int> seen;
  std::int64_t checksum_rows = 0;
  for (const SaveItem& i : plan.items) {
    // Pieces of one key (the parts of a flat range) are told apart by a suffix; their placement says
    // where each goes.
    const int n = seen[i.key]++;
    const Box whole = whole_box(i.data.shape().dims());
    specs.push_back({n ? cat(i.key, "@", n) : i.key, i.dtype, i.data.shape().to_vector(),
                     PiecePlacement{i.key, i.global_shape, i.box}, {}, {}});
    if (!whole.empty()) specs.back().slabs.push_back({whole, checksum_rows});
    checksum_rows += checksum_rows_of(whole);
  }
  try {
    io::TemporaryFile temp = io::TemporaryFile::create(io::Destination::of(path));
    const Skeleton skeleton =
        create_skeleton(temp.file(), specs, {CheckpointKind::local, plan.params, plan.common, io::random_id()}, checksum_rows);
    PieceWriter writer(temp.file(), method, ChecksumSlot{skeleton.checksums_address, 0});
    for (std::size_t n = 0; n < plan.items.size(); ++n)
      writer.write(skeleton.datasets[n], whole_box(plan.items[n].data.shape().dims()), plan.items[n].data);
    writer.finish();
    mark_complete(temp.file(), skeleton.data);
    temp.commit();
  } catch (Error& e) {
    throw std::move(e.add_context(cat("while saving the local checkpoint ", path.string())));
  }
}

Values load_local_into(const fs::path& path, const StateDict& state, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_with(reader, state, options, CheckpointKind::local);
}

LoadedState load_local(const fs::path& path, const StateDict& request, LoadOptions options) {
  Allocated a = allocate_destinations(request);
  Values values = load_local_into(path, a.state, options);
  return LoadedState(std::move(a.buffers), std::move(values));
}

}  // namespace shardckpt
