// shardckpt.layout: the geometry of a GTP-sharded parameter, as values. Given rows, group size and
// alignment it says which padded rows each GTP rank holds; given the fused sections of a weight and
// its TP split it says which piece of which block each rank saves, at which global offset; given the
// pieces of many ranks it proves that they tile every block exactly once.
// It never touches memory or files: every function here is arithmetic on small values.
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>
export module shardckpt.layout;
import shardckpt.core;

export namespace shardckpt {

// A half-open range [begin, end) of indices: rows, columns (flattened trailing elements), elements of
// a flattened shard, bytes of a file. The one range of the library.
struct Range {
  std::int64_t begin = 0;
  std::int64_t end = 0;

  constexpr std::int64_t size() const noexcept { return end > begin ? end - begin : 0; }
  constexpr bool empty() const noexcept { return end <= begin; }
  constexpr bool contains(std::int64_t i) const noexcept { return begin <= i && i < end; }
  constexpr Range intersect(Range o) const noexcept { return {std::max(begin, o.begin), std::min(end, o.end)}; }
  friend constexpr bool operator==(Range, Range) = default;
};

// GTP geometry of one parameter of R rows over a group of G ranks with alignment A: the block is
// B = A*G rows, P = (B - R mod B) mod B pad rows make R + P, and GTP rank g holds padded rows
// [g*L, (g+1)*L) with L = (R + P) / G. Pad rows sit at the tail; ranks whose padded rows are all pad
// are padding-only.
class GtpGeometry {
 public:
  constexpr GtpGeometry() = default;
  // \requires rows >= 1, group >= 1, align >= 0; align == 0 requires rows % group == 0.
  // Throws Errc::layout naming the numbers otherwise.
  static GtpGeometry make(std::int64_t rows, std::int64_t group, std::int64_t align);

  constexpr std::int64_t rows() const noexcept { return rows_; }
  constexpr std::int64_t group() const noexcept { return group_; }
  constexpr std::int64_t align() const noexcept { return align_; }
  constexpr std::int64_t block() const noexcept { return align_ * group_; }
  constexpr std::int64_t pad() const noexcept { return pad_; }
  constexpr std::int64_t shard_rows() const noexcept { return shard_rows_; }

  constexpr Range padded_rows(std::int64_t g) const noexcept { return {g * shard_rows_, (g + 1) * shard_rows_}; }
  constexpr std::int64_t real_count(std::int64_t g) const noexcept {
    return std::clamp<std::int64_t>(rows_ - g * shard_rows_, 0, shard_rows_);
  }
  constexpr Range real_rows(std::int64_t g) const noexcept {
    return {g * shard_rows_, g * shard_rows_ + real_count(g)};
  }
  constexpr bool padding_only(std::int64_t g) const noexcept { return real_count(g) == 0; }
  constexpr std::int64_t padding_only_ranks() const noexcept { return pad_ / shard_rows_; }

 private:
  std::int64_t rows_ = 0, group_ = 1, align_ = 0, pad_ = 0, shard_rows_ = 0;
};

// A named run of TP-local rows of a fused weight. An empty name marks a plain weight: its one
// block is saved under the parameter key itself.
struct Section {
  std::string name;
  std::int64_t rows = 0;
  friend bool operator==(const Section&, const Section&) = default;
};

// A global model size that the TP degree must divide ({"heads", 8}, {"groups", 4}): TP ranks split
// whole heads and groups, so a TP that divides the rows of every block but not the heads is no
// layout of the model. Parameters carry theirs, and so do the records of a checkpoint.
struct TpDivisor {
  std::string name;
  std::int64_t count = 0;
  friend bool operator==(const TpDivisor&, const TpDivisor&) = default;
};

// Throws Errc::layout unless `tp` divides every divisor, with the one message of that refusal:
// `<key>: heads (8) does not divide by TP 3` (no `<key>: ` when `key` is empty). Also throws when tp < 1.
void require_tp_divides(std::string_view key, std::span<const TpDivisor> divisors, std::int64_t tp);

// Global model sizes that fused layouts are computed from.
struct SsmDims {
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t groups = 0;
  std::int64_t state = 0;
  std::int64_t householder = 1;
};

// What TP must divide in a model of `dims`: {{"heads", dims.heads}, {"groups", dims.groups}}. The
// divisors of every parameter whose layout is computed from them (fused GDP and Mamba weights).
std::vector<TpDivisor> ssm_divisors(const SsmDims& dims);

// TP-local sections of the fused layouts (their sizes: docs/python.md, "The fused-layout rule").
// Throw Errc::layout when a size is not positive, or heads or groups do not divide by tp
// (require_tp_divides, without a key).
std::vector<Section> gdp_in_proj_sections(const SsmDims& dims, std::int64_t tp);
std::vector<Section> gdp_conv1d_sections(const SsmDims& dims, std::int64_t tp);
std::vector<Section> mamba_in_proj_sections(const SsmDims& dims, std::int64_t tp);
std::vector<Section> mamba_conv1d_sections(const SsmDims& dims, std::int64_t tp);

// The most Householder steps (and so blocks) a fused layout may have; more is a typo, not a model.
inline constexpr std::int64_t max_householder = 1 << 16;
std::vector<Section> plain_sections(std::int64_t rows);

// How tensor parallelism splits the global weight: along dim 0 block by block (column-parallel and
// fused weights), along dim 1 (row-parallel weights, one section), or not at all (replicas).
enum class TpAxis : std::uint8_t { rows, cols, replicated };
std::string_view tp_axis_name(TpAxis axis) noexcept;
TpAxis parse_tp_axis(std::string_view name);

// One parameter as a TP rank holds it before GTP: key, sections (TP-local rows, in row order), the
// TP-local trailing dims, whose elements are contiguous per row, and the global model sizes that
// its TP degree must divide (ssm_divisors for a fused GDP or Mamba weight; none for most weights).
struct ParamSpec {
  std::string key;
  std::vector<Section> sections;
  std::vector<std::int64_t> trailing;
  TpAxis tp_axis = TpAxis::rows;
  std::int64_t tp = 1;
  std::vector<TpDivisor> divisors;

  // R: TP-local rows, all sections together; C: elements of one row. Throw Errc::layout on overflow.
  std::int64_t rows() const;
  std::int64_t row_elems() const;
};

// Throws Errc::layout (or invalid_argument for the key) when the spec cannot be planned: among
// others when tp does not divide a divisor (require_tp_divides), or a divisor is unnamed, named
// twice or not positive.
void validate(const ParamSpec& spec);

// `<param key>.<name>`, or the parameter key for an unnamed (plain) section.
std::string block_key(std::string_view param_key, std::string_view name);

// A block: one section as the checkpoint stores it, under its own key with the global shape a plain
// TP run writes.
struct Block {
  std::string key;
  Range local_rows;  // TP-local rows of the weight
  std::vector<std::int64_t> global_shape;
};
std::vector<Block> blocks(const ParamSpec& spec);

// A fused (or plain) parameter as a checkpoint records it, whatever TP saved it: its blocks with their
// global row counts, in row order, the global trailing dims and the model sizes TP must divide. Enough
// to plan it at any TP, and to refuse a TP that is no layout of the model.
struct ParamRecord {
  std::string key;
  TpAxis tp_axis = TpAxis::rows;
  std::vector<Section> blocks;
  std::vector<std::int64_t> trailing;
  std::vector<TpDivisor> divisors;
  friend bool operator==(const ParamRecord&, const ParamRecord&) = default;
};
// A parameter's record, and the parameter a record describes planned at another TP degree. The one
// conversion between the two: spec_at_tp throws Errc::layout when tp does not divide a divisor (first,
// with require_tp_divides' message), a block's rows or dim 1, or the record has no block.
ParamRecord record_of(const ParamSpec& spec);
ParamSpec spec_at_tp(const ParamRecord& record, std::int64_t tp);

// Where a rank sits in the parallel layout. Ranks, group sizes and row counts are all int64.
struct ShardCoord {
  std::int64_t tp_rank = 0;
  std::int64_t gtp_rank = 0;
};

// What one rank saves of one block: `rows` rows of its padded shard starting at `shard_row`,
// stored at `global_offset` in the block's dataset. `count` is the hyperslab extent (rows, then the
// TP-local trailing dims).
struct Piece {
  std::string key;
  std::size_t block = 0;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> global_offset;
  std::vector<std::int64_t> count;
  std::int64_t rows = 0;
  std::int64_t shard_row = 0;
};

// Everything one (tp_rank, gtp_rank) saves of a parameter, pieces in row order.
struct RankPlan {
  ShardCoord coord;
  GtpGeometry geometry;
  std::int64_t row_elems = 0;  // C
  std::int64_t real_rows = 0;  // n_g
  bool padding_only = false;
  bool main_replica = true;  // false for TP replicas of a replicated weight
  std::vector<Piece> pieces;
};

// \requires validate(spec) passes; 0 <= tp_rank < spec.tp; 0 <= gtp_rank < gtp.
RankPlan plan_rank(const ParamSpec& spec, std::int64_t gtp, std::int64_t align, ShardCoord coord);

// The rectangle a piece covers in its dataset viewed as (dim 0, flattened trailing elements).
struct Box {
  Range rows;
  Range cols;

  constexpr bool empty() const noexcept { return rows.empty() || cols.empty(); }
  constexpr Box intersect(const Box& o) const noexcept { return {rows.intersect(o.rows), cols.intersect(o.cols)}; }
  friend constexpr bool operator==(const Box&, const Box&) = default;
};

// The box of the slab at `offset` with extent `count` of a dataset of `global_shape`; throws
// Errc::invalid_argument naming `key` when it leaves the dataset or splits a dim past dim 1 (only
// dims 0 and 1 are ever split by TP and GTP). A scalar (rank 0: offset and count empty too) is its
// whole box, one row of one element.
Box footprint(std::string_view key, std::span<const std::int64_t> global_shape, std::span<const std::int64_t> offset,
              std::span<const std::int64_t> count);
// True when a slab splits a dim past dim 1 (footprint refuses it; slab_parts cuts it up).
bool splits_past_dim1(std::span<const std::int64_t> global_shape, std::span<const std::int64_t> offset,
                      std::span<const std::int64_t> count);
// A run of a slab's elements that is contiguous both in the slab (C order) and in its dataset: its
// box (one row of dim 0, a range of that row's elements), the slab row it lies in and the offset of
// its first element among the slab's elements.
struct SlabPart {
  Box box;
  std::int64_t slab_row = 0;
  std::int64_t slab_offset = 0;
};
// The parts of a slab that splits a dim past dim 1 (a layer-stacked weight split by TP on its last
// dim, say): one per row of dim 0 and index of each dim before the last split dim, in the slab's
// element order. Throws Errc::invalid_argument naming `key` when the slab leaves the dataset, and
// when it has more than `max_slab_parts` parts.
inline constexpr std::int64_t max_slab_parts = std::int64_t{1} << 22;
std::vector<SlabPart> slab_parts(std::string_view key, std::span<const std::int64_t> global_shape,
                                 std::span<const std::int64_t> offset, std::span<const std::int64_t> count);
// The box of a whole dataset of `shape`: its rows by its flattened trailing elements; for a scalar
// (an empty shape) one row of one element. The one place that says how many rows a global shape has.
Box whole_box(std::span<const std::int64_t> shape);

// One rank's claim on part of a dataset, as exchanged before a save: enough to check that all
// ranks agree and that the writers' boxes tile every dataset exactly once. A box may cover part of
// a row (a distributed optimizer's flat range starts and ends anywhere).
struct Claim {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> global_shape;
  Box box;
  int rank = 0;
  bool writes = true;  // false for a replica that holds the data but leaves writing it to others
};

// Member `index` of `count`'s part of [0, n), when n is split as evenly as possible, in order.
Range balanced_share(std::int64_t n, std::int64_t count, std::int64_t index);

// Part of a piece that a flat range of its shard covers: `box` in the piece's dataset, whose first
// element is element `range_offset` of the range.
struct FlatPart {
  Box box;
  std::int64_t range_offset = 0;
};
// The boxes that the elements [range.begin, range.end) of a padded shard (flattened row by row,
// `row_elems` elements a row) cover of `piece`: at most three (a partial first row, whole rows, a
// partial last row), in order.
std::vector<FlatPart> flat_parts(const Piece& piece, std::int64_t row_elems, Range range);
// The elements of a box (rows x columns), checked.
std::int64_t box_elements(const Box& box);

// A box and who writes it (a rank, a slab of a file).
struct OwnedBox {
  Box box;
  std::int64_t owner = 0;
};
// What keeps `boxes` (all inside `whole`) from covering `whole` exactly once: up to `limit`
// sentences naming the key, the rows and the owners (called `owner_noun`s) of gaps and overlaps;
// empty when they tile it. O(n log n) when they do.
std::vector<std::string> tiling_problems(std::string_view key, std::span<const OwnedBox> boxes, const Box& whole,
                                         std::string_view owner_noun, std::size_t limit = 16);

// Checks the claims of all ranks together: per key one dtype and one global shape, every box inside
// its dataset, and the writers' boxes cover every element exactly once. Throws
// Errc::dtype_mismatch, shape_mismatch, invalid_argument or tiling with the key, the ranks and the
// rows involved.
void validate_claims(std::span<const Claim> claims);

}  // namespace shardckpt
