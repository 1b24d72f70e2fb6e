// shardckpt.merge.seam:pieces: what the save and the load of a state dict share: one piece function
// (views of a shard's rows at their dataset boxes), the rows one data-parallel copy handles, checks of
// datasets and destinations, and the staging arena through which device rows go to and from files.
// It never allocates a destination or copies a shard: pieces are views.
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module shardckpt.merge.seam:pieces;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;

export namespace shardckpt {

// Elements [offset, offset + rows * cols) of a 1-D view, seen as `rows` rows of `cols`.
template <bool Mutable>
inline BasicView<Mutable> reshaped(BasicView<Mutable> flat, std::int64_t offset, std::int64_t rows, std::int64_t cols) {
  require(offset >= 0 && rows * cols <= flat.shape().elements() - offset, Errc::internal, "a flat part past its range");
  return BasicView<Mutable>::unchecked(flat.data() + offset * element_bytes(flat.dtype()), flat.dtype(), {rows, cols},
                                    flat.space());
}

// Rows [begin, end) of a shard's real rows that this copy reads (all, unless it shares).
inline Range own_rows(std::int64_t rows, int replica_id, int replicas, bool share) {
  return share && replicas > 1 ? balanced_share(rows, replicas, replica_id) : Range{0, rows};
}

// One piece of a state dict's entry as save and load both see it: the box of the dataset `key` (of
// `global_shape`) and the view of the entry's rows that fill it (read-only when saved, mutable when
// loaded). `main` is false for a replica that does not write it (a TP replica of a replicated weight).
template <bool Mutable>
struct PieceView {
  std::string_view key;
  DType dtype = DType::f32;
  std::span<const std::int64_t> global_shape;
  Box box;
  bool main = true;
  BasicView<Mutable> rows;
};

// Calls f(PieceView) for each piece of tensor `t`'s rows `mine` (rows of its local shape) in `data`:
// one per run contiguous in the shard and the dataset when the slab splits a dim past dim 1, else
// one box (empty when `mine` is).
template <bool Mutable, class F>
void tensor_pieces(const ShardedTensor& t, BasicView<Mutable> data, Range mine, F&& f) {
  if (splits_past_dim1(t.global_shape, t.global_offset, t.count())) {
    for (const SlabPart& part : slab_parts(t.key, t.global_shape, t.global_offset, t.count()))
      if (mine.contains(part.slab_row))
        f(PieceView<Mutable>{t.key, t.dtype, t.global_shape, part.box, true,
                             reshaped(data, part.slab_offset, 1, part.box.cols.size())});
    return;
  }
  const Box box = footprint(t.key, t.global_shape, t.global_offset, t.count());
  const Box mine_box{{box.rows.begin + mine.begin, box.rows.begin + mine.end}, box.cols};
  f(PieceView<Mutable>{t.key, t.dtype, t.global_shape, mine_box, true, data.slice_rows(mine.begin, mine.end)});
}

// Calls f(PieceView) for each piece of parameter `p`'s shard `shard` (planned as `plan`): with a flat
// range, each block's part of the range (an empty box for a block the range holds none of: the checks
// across ranks then still see its key); else the rows `mine` of the shard's real rows in each block
// (blocks it holds none of skipped). Pad rows are in no piece.
template <bool Mutable, class F>
void param_pieces(const ShardedParam& p, const RankPlan& plan, BasicView<Mutable> shard, Range mine, F&& f) {
  if (p.flat) {
    for (const Piece& piece : plan.pieces) {
      const std::vector<FlatPart> parts = flat_parts(piece, plan.row_elems, {p.flat->begin, p.flat->end});
      for (const FlatPart& part : parts)
        f(PieceView<Mutable>{piece.key, p.dtype, piece.global_shape, part.box, plan.main_replica,
                             reshaped(shard, part.range_offset, part.box.rows.size(), part.box.cols.size())});
      if (parts.empty())
        f(PieceView<Mutable>{piece.key, p.dtype, piece.global_shape, Box{}, plan.main_replica,
                             reshaped(shard, 0, 0, 0)});
    }
    return;
  }
  for (const Piece& piece : plan.pieces) {
    const Range rows = Range{piece.shard_row, piece.shard_row + piece.rows}.intersect(mine);
    if (rows.empty()) continue;
    const Box box = footprint(piece.key, piece.global_shape, piece.global_offset, piece.count);
    const std::int64_t first = box.rows.begin + rows.begin - piece.shard_row;
    f(PieceView<Mutable>{piece.key, p.dtype, piece.global_shape, Box{{first, first + rows.size()}, box.cols},
                         plan.main_replica, shard.slice_rows(rows.begin, rows.end)});
  }
}

// Checks that the checkpoint's dataset can serve a slab of `dtype` at `global_shape`.
inline void check_dataset(const Dataset& d, DType dtype, std::span<const std::int64_t> global_shape,
                   std::string_view who) {
  require(d.dtype == dtype, Errc::dtype_mismatch, "key ", d.key, ": the checkpoint holds ", dtype_name(d.dtype),
          " but ", who, " asks for ", dtype_name(dtype));
  require(std::equal(d.shape.begin(), d.shape.end(), global_shape.begin(), global_shape.end()), Errc::shape_mismatch,
          "key ", d.key, ": the checkpoint holds global shape ", dims_text(d.shape), " but ", who, " expects ",
          dims_text(global_shape));
}

// The view a load writes an entry into: its destination, which must be there, of its dtype and shape,
// and writable.
inline MutTensorView load_view(TensorRef& ref, DType dtype, const Extents& shape, std::string_view who) {
  require(static_cast<bool>(ref), Errc::invalid_argument, who, ": the request has no destination to load into");
  require(ref.dtype() == dtype && ref.shape() == shape, Errc::shape_mismatch, who, ": the destination is ",
          dtype_name(ref.dtype()), " ", dims_text(ref.shape().dims()), ", not ", dtype_name(dtype), " ",
          dims_text(shape.dims()));
  require(ref.writable(), Errc::invalid_argument, who,
          ": a read-only entry (TensorRef::read_only, or a borrowed TensorView) cannot be loaded into: give the "
          "state dict a non-const SharedBuffer or borrow a MutTensorView");
  return ref.mut_view();
}

// The pool's buffers, used in turn as arenas: the rows of many pieces packed into one buffer, one
// fence per buffer. Before a buffer is reused, the engine has finished the work enqueued while it
// was current (and `before_reuse` has dealt with its rows), so copying into or out of one buffer
// overlaps with reading or writing another.
class Arena {
 public:
  explicit Arena(std::shared_ptr<StagingPool> pool)
      : pool_(std::move(pool)), fences_(static_cast<std::size_t>(pool_->buffers())) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  // Work an error left may still copy into or out of the buffers: the pool goes back (to its owner,
  // or to the library's pools for the next save or load) only once the engine is done with them.
  // After a drain nothing is left to wait for.
  ~Arena() {
    if (!drained_) try {
        engine().wait(engine().fence());
      } catch (...) {  // the error that ended the transfer is the one its caller reports
      }
  }

  CopyEngine& engine() const { return pool_->engine(); }
  int current() const noexcept { return current_; }
  int buffers() const noexcept { return pool_->buffers(); }

  // Room for up to `rows` rows shaped like `like`: as many as fit in the current buffer, or, when not
  // one more fits, in the next one.
  template <class BeforeReuse>
  MutTensorView take(TensorView like, std::int64_t rows, BeforeReuse&& before_reuse) {
    const std::size_t row = std::max<std::size_t>(like.row_bytes(), 1);
    (void)pool_->rows_per_buffer(like);  // a row larger than a buffer is an error
    drained_ = false;
    if (aligned(used_) + row > pool_->buffer_bytes()) {
      fences_[static_cast<std::size_t>(current_)] = engine().fence();
      current_ = (current_ + 1) % pool_->buffers();
      retire(current_, before_reuse);
      used_ = 0;
    }
    const std::size_t at = aligned(used_);
    const auto fit = std::min<std::int64_t>(rows, static_cast<std::int64_t>((pool_->buffer_bytes() - at) / row));
    used_ = at + static_cast<std::size_t>(fit) * row;
    return MutTensorView::unchecked(pool_->buffer(current_).data() + at, like.dtype(), like.shape().with_rows(fit),
                                 MemorySpace::pinned());
  }

  // Waits for every buffer's work, oldest first, calling before_reuse on each that was used.
  template <class BeforeReuse>
  void drain(BeforeReuse&& before_reuse) {
    if (used_ > 0) fences_[static_cast<std::size_t>(current_)] = engine().fence();
    for (int i = 1; i <= pool_->buffers(); ++i) retire((current_ + i) % pool_->buffers(), before_reuse);
    used_ = 0;
    drained_ = true;
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

  std::shared_ptr<StagingPool> pool_;
  std::vector<std::optional<Fence>> fences_;
  int current_ = 0;
  std::size_t used_ = 0;
  bool drained_ = true;  // no work enqueued since the last drain (or ever)
};

}  // namespace shardckpt
