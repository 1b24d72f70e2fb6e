// shardckpt.state: state dicts and their save and load planning. A state dict holds sharded tensors,
// GTP-sharded parameters (factories: expanded into views of their shard's rows on save, merged back
// into a padded shard on load), common values and local non-persistent values. prepare_save turns a
// state dict into writes without copying a byte; a load reads each piece straight into its rows of
// the destination shard, takes each padding-only rank's placeholder from the request as a local
// value, and only then merges every factory against the complete loaded tree (loaded shards,
// common values, local values), on the global path and the per-rank local path alike.
// Nothing here knows about ranks beyond the state dict it is given: coordination lives in dist.
module;
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>
export module shardckpt.state;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.format;

export namespace shardckpt {

// A shard of a tensor under its global key. On save `data` is the shard; in a load request only
// dtype and shape matter and `data` stays empty.
struct ShardedTensor {
  std::string key;
  DType dtype = DType::f32;
  Extents shape;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> global_offset;
  int replica_id = 0;  // only replica 0 (the main replica) writes
  TensorView data;

  static ShardedTensor of(std::string key, TensorView data, std::vector<std::int64_t> global_shape,
                          std::vector<std::int64_t> global_offset, int replica_id = 0);
  static ShardedTensor expect(std::string key, DType dtype, Extents shape, std::vector<std::int64_t> global_shape,
                              std::vector<std::int64_t> global_offset);
};

// A GTP-sharded parameter as one rank holds it: the factory of SPEC.md. `shard` is the padded
// shard of shard_shape() rows (pad rows zero); empty in a load request.
struct ShardedParam {
  ParamSpec spec;
  std::int64_t gtp = 1;
  std::int64_t align = 0;
  ShardCoord coord;
  DType dtype = DType::f32;
  int replica_id = 0;  // data-parallel replica: only replica 0 writes
  TensorView shard;

  GtpGeometry geometry() const { return GtpGeometry::make(spec.rows(), gtp, align); }
  Extents shard_shape() const;
};

class StateDict {
 public:
  // Each key may appear once across all kinds; throws Errc::invalid_argument otherwise.
  void add(ShardedTensor tensor);
  void add(ShardedParam param);
  void add_common(std::string key, CommonValue value);
  // Never saved; a load hands it back as it was given in the request.
  void add_local(std::string key, CommonValue value);

  const std::vector<ShardedTensor>& tensors() const noexcept { return tensors_; }
  const std::vector<ShardedParam>& params() const noexcept { return params_; }
  const std::map<std::string, CommonValue, std::less<>>& common() const noexcept { return common_; }
  const std::map<std::string, CommonValue, std::less<>>& local() const noexcept { return local_; }

 private:
  void claim_key(const std::string& key);
  std::vector<ShardedTensor> tensors_;
  std::vector<ShardedParam> params_;
  std::map<std::string, CommonValue, std::less<>> common_;
  std::map<std::string, CommonValue, std::less<>> local_;
  std::map<std::string, int, std::less<>> keys_;
};

// One write of a save: a view and the slab it fills.
struct SaveItem {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> global_offset;
  std::vector<std::int64_t> count;
  bool main_replica = true;
  TensorView data;
};

// A state dict after save preprocessing: views and metadata, no tensor data of its own. A
// padding-only rank contributes no item for a parameter: nothing of it reaches the file.
struct SavePlan {
  std::vector<SaveItem> items;
  std::vector<ParamRecord> params;
  std::map<std::string, CommonValue, std::less<>> common;
};

// Expands factories into pieces (views of the shard's rows) and checks every shard's shape; throws
// Errc::shape_mismatch or dtype_mismatch naming the key, the rank coordinates and the rows.
SavePlan prepare_save(const StateDict& state);
// The claims of one rank, for validate_claims.
std::vector<Claim> claims_of(const SavePlan& plan, int rank);
// Writes this rank's main-replica items, in order, into a skeleton whose datasets are `datasets`.
void write_items(const SavePlan& plan, std::span<const DatasetInfo> datasets, PieceWriter& writer);

// A loaded state: tensors this rank owns now, and values.
class LoadedState {
 public:
  using Entry = std::variant<HostBuffer, CommonValue>;
  explicit LoadedState(std::map<std::string, Entry, std::less<>> entries) : entries_(std::move(entries)) {}

  bool contains(std::string_view key) const { return entries_.contains(key); }
  std::vector<std::string> keys() const;
  // Throws Errc::missing_key when absent or not a tensor (value).
  const HostBuffer& tensor(std::string_view key) const [[clang::lifetimebound]];
  HostBuffer take_tensor(std::string_view key);
  const CommonValue& value(std::string_view key) const [[clang::lifetimebound]];

 private:
  std::map<std::string, Entry, std::less<>> entries_;
};

struct LoadOptions {
  IoMethod method = IoMethod::direct;
  // Check every byte read against the checksum saved with it: a mismatch is Errc::corrupt naming
  // the file, the key and the rows. Off only to read a damaged checkpoint on purpose.
  bool verify_checksums = true;
  // Told once per load when the checkpoint predates checksums (format version 1), so its bytes
  // cannot be checked. Unset: one line on standard error (rank 0 only, in a collective load).
  std::function<void(std::string_view)> notice = {};
  // When set, the checkpoint must carry this id (CheckpointContents::id): a checkpoint that another
  // save replaced since the caller looked at it is Errc::replaced, not a silent switch.
  std::string expect_id = {};
  // Told, on the rank that reads them, how many more bytes were read (progress reports).
  BytesDone progress = {};
};

// Loads this rank's part of a global checkpoint at the request's layout (any TP, GTP, alignment).
// Throws Errc::missing_key, shape_mismatch, dtype_mismatch, not_a_checkpoint or corrupt, changing
// nothing.
LoadedState load(const std::filesystem::path& path, const StateDict& request, LoadOptions options = {});
// The same from a checkpoint already open (a collective load opens it once per rank).
LoadedState load(const CheckpointReader& reader, const StateDict& request, LoadOptions options = {});
// Tells LoadOptions::notice (or standard error) that the checkpoint predates checksums, if it does.
void notice_unchecked(const CheckpointReader& reader, const LoadOptions& options);

// Where one rank sits in the layout a tool loads a checkpoint at.
struct LoadLayout {
  std::int64_t tp = 1;
  std::int64_t gtp = 1;
  std::int64_t align = 0;
  ShardCoord coord;
  int replica_id = 0;
};
// The load request of one rank for every tensor of a global checkpoint, from the checkpoint's own
// records: each parameter record planned at the layout's TP, GTP and alignment; every dataset no
// record names as one plain parameter replicated on every TP rank. What a tool that knows no model
// (shardckpt load, reshard) asks for.
StateDict request_all(const CheckpointReader& reader, const LoadLayout& layout);

// The per-rank path: a rank saves its own preprocessed state (its pieces at their local shapes) to
// its own file, and loads it back at the same layout. A padding-only rank's parameters are not in
// the file: the load rebuilds their placeholders from the request.
void save_local(const StateDict& state, const std::filesystem::path& path, IoMethod method = IoMethod::direct);
LoadedState load_local(const std::filesystem::path& path, const StateDict& request, LoadOptions options = {});

}  // namespace shardckpt
