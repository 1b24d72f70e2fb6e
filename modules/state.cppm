// shardckpt.state: the data model of a rank's state. A state dict holds sharded tensors,
// GTP-sharded parameters (factories: one parameter expanded into views of its shard's rows on save,
// merged back into a padded shard on load), common values and local non-persistent values; the
// tensors are TensorRefs, which keep memory the library allocated alive or say that they borrow. A
// loaded state is what a load that allocates hands back. This module computes nothing about files:
// shardckpt.merge turns state dicts into pieces and back, shardckpt.storage writes and reads them.
module;
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module shardckpt.state;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;

export namespace shardckpt {

// A shard of a tensor under its global key. On save `data` holds the shard; in a load request it
// is the destination that load_into fills, or empty for load() to allocate. A scalar (a 0-d tensor:
// `global_shape` and `global_offset` empty) is one element, which views hold as `shape` {1} (every
// view has at least one dim); it is saved as a dataset of scalar dataspace.
struct ShardedTensor {
  std::string key;
  DType dtype = DType::f32;
  Extents shape;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> global_offset;
  int replica_id = 0;  // which of `replicas` data-parallel copies of this shard this is
  int replicas = 1;    // each copy writes a balanced share of its rows (and reads one, see LoadOptions)
  TensorRef data;

  bool scalar() const noexcept { return global_shape.empty(); }
  // Where the shard lies in its dataset: `global_offset`, and `shape`'s dims (none for a scalar).
  std::span<const std::int64_t> count() const noexcept [[clang::lifetimebound]] {
    return scalar() ? std::span<const std::int64_t>() : shape.dims();
  }

  static ShardedTensor of(std::string key, TensorRef data, std::vector<std::int64_t> global_shape,
                          std::vector<std::int64_t> global_offset, int replica_id = 0, int replicas = 1);
  // For a scalar, `shape` may be given as Extents{} (rank 0) or {1}: it becomes {1}.
  static ShardedTensor expect(std::string key, DType dtype, Extents shape, std::vector<std::int64_t> global_shape,
                              std::vector<std::int64_t> global_offset, int replica_id = 0, int replicas = 1);
};

// A GTP-sharded parameter as one rank holds it: a factory (expanded into pieces on save, merged back
// against the complete loaded tree on load; docs/design.md). `shard` is the padded shard
// (pad rows zero), or with `flat` the 1-D tensor of that range of it.
struct ShardedParam {
  ParamSpec spec;
  std::int64_t gtp = 1;
  std::int64_t align = 0;
  ShardCoord coord;
  DType dtype = DType::f32;
  int replica_id = 0;  // which of `replicas` data-parallel copies of this shard this is
  int replicas = 1;    // each copy writes a balanced share of the shard's real rows
  // Elements [begin, end) of the padded shard flattened row by row: the part of the parameter that one
  // data-parallel rank of a distributed optimizer owns (as Megatron's distributed optimizer does).
  std::optional<Range> flat = {};
  TensorRef shard = {};

  GtpGeometry geometry() const { return GtpGeometry::make(spec.rows(), gtp, align); }
  // "parameter K (TP rank t, GTP rank g)", for messages.
  std::string describe() const;
  // (L, trailing...): the whole padded shard.
  Extents padded_shape() const;
  // What `shard` holds: the padded shard, or the flat range's elements as a 1-D tensor.
  Extents shard_shape() const;
};

// The flat range of `rank` of `ranks` data-parallel ranks of a distributed optimizer: a balanced,
// contiguous share of the padded shard's elements.
Range distributed_range(const ShardedParam& param, int rank, int ranks);

// The prefix of optimizer state keys.
inline constexpr std::string_view optimizer_state_prefix = "optimizer.state.";

// The companion of a parameter that holds optimizer state `name` (exp_avg, exp_avg_sq, fp32_param):
// the same layout (sections, TP split, GTP padding, flat range) under the key
// optimizer.state.<name>.<parameter key>, in `dtype`, without data.
ShardedParam optimizer_state(const ShardedParam& param, std::string_view name, DType dtype);

// A parameter that passed the checks of StateDict::add (its geometry, coordinates, replicas and
// flat range): made only by check_param, read-only but for its shard. For who needs what the checks
// make sure of before adding it (a C caller's raw buffer is typed by the padded shard's shape).
class CheckedParam {
 public:
  const ShardedParam& param() const noexcept [[clang::lifetimebound]] { return param_; }
  // The rows of the shard that hold the weight's rows (the rest are pad rows), from the plan the
  // check made.
  std::int64_t real_rows() const noexcept { return real_rows_; }
  // The shard, given once the shape it must have is known.
  CheckedParam&& with_shard(TensorRef shard) && [[clang::lifetimebound]] {
    param_.shard = std::move(shard);
    return std::move(*this);
  }

 private:
  friend CheckedParam check_param(ShardedParam param);
  friend class StateDict;
  CheckedParam(ShardedParam param, std::int64_t real_rows) : param_(std::move(param)), real_rows_(real_rows) {}
  ShardedParam param_;
  std::int64_t real_rows_ = 0;
};
// Throws Errc::layout or invalid_argument, naming the parameter and its coordinates, for what
// StateDict::add refuses.
CheckedParam check_param(ShardedParam param);

class StateDict {
 public:
  // Each key may appear once across all kinds, except that several ShardedTensor entries may name
  // parts of one tensor (same global shape and dtype); throws Errc::invalid_argument otherwise.
  void add(ShardedTensor tensor);
  void add(ShardedParam param);  // add(check_param(param))
  void add(CheckedParam param);   // checked already: only its key is
  void add_common(std::string key, CommonValue value);
  // Never saved; a load hands it back as it was given in the request.
  void add_local(std::string key, CommonValue value);

  // The entries as add() checked them: read-only, so that no key, dtype, shape or layout changes
  // past its checks.
  const std::vector<ShardedTensor>& tensors() const noexcept [[clang::lifetimebound]] { return tensors_; }
  const std::vector<ShardedParam>& params() const noexcept [[clang::lifetimebound]] { return params_; }
  // The memory of tensor `i` (tensors()[i].data) and of parameter `i`'s shard (params()[i].shard): the
  // one part of an entry its owner may change (a load fills it; a trainer may point it at other
  // memory, which saves and loads check against the entry). A const state dict lends none. Throws
  // Errc::invalid_argument for an index past the entries.
  TensorRef& mut_data(std::size_t i) [[clang::lifetimebound]];
  TensorRef& mut_shard(std::size_t i) [[clang::lifetimebound]];
  const Values& common() const noexcept [[clang::lifetimebound]] {
    return common_;
  }
  const Values& local() const noexcept [[clang::lifetimebound]] {
    return local_;
  }

 private:
  void claim_key(const std::string& key);
  std::vector<ShardedTensor> tensors_;
  std::vector<ShardedParam> params_;
  Values common_;
  Values local_;
  std::map<std::string, int, std::less<>> keys_;
};

// A loaded state: tensors this rank owns now (host memory), and values.
class LoadedState {
 public:
  LoadedState(std::map<std::string, SharedBuffer, std::less<>> tensors, Values values)
      : tensors_(std::move(tensors)), values_(std::move(values)) {}

  bool contains(std::string_view key) const { return tensors_.contains(key) || values_.contains(key); }
  std::vector<std::string> keys() const;
  // Throws Errc::missing_key when absent or not a tensor (value). The loaded state owns its
  // tensors: a non-const one lends them writable (a state dict entry made from one may be loaded
  // into), a const one only for reading (TensorRef::read_only).
  const SharedBuffer& tensor(std::string_view key) const& [[clang::lifetimebound]];
  SharedBuffer& tensor(std::string_view key) & [[clang::lifetimebound]];
  // A temporary loaded state's tensors would outlive it only as dangling references.
  const SharedBuffer& tensor(std::string_view key) const&& = delete;
  const CommonValue& value(std::string_view key) const [[clang::lifetimebound]];
  const Values& values() const noexcept [[clang::lifetimebound]] { return values_; }

 private:
  std::map<std::string, SharedBuffer, std::less<>> tensors_;
  Values values_;
};

}  // namespace shardckpt
