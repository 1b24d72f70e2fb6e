// shardckpt.merge: one rank's state dict to pieces and back (docs/design.md, "Load: straight into the
// destination rows": the complete tree first, then the factory merges).
// On save, factories expand into views of their shard's rows (pieces, never a copy): replicas of one
// shard each write a balanced share, a distributed optimizer's rank writes its flat range of the
// shard. On load, each piece is read straight into its destination rows, where they are (host, or
// device through a pool of pinned buffers), each padding-only rank's placeholder is taken from the
// request as a local value, and only then is every factory merged against the complete loaded tree
// (loaded shards, common values, local values), on the global path and the per-rank local path
// alike. Nothing here knows about ranks beyond the state dict it is given: coordination lives in
// shardckpt.dist, which holds the one family of saves and loads (load_into and load, with a process
// group or without); what dist needs of merge and no user calls is the library's own module
// shardckpt.merge.seam (src/merge/seam.cppm), never installed.
module;
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>
export module shardckpt.merge;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;

export namespace shardckpt {

// One write of a save: a view and the box of its dataset it fills (rows by flattened trailing
// elements; one row of the view per row of the box).
struct SaveItem {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> global_shape;
  Box box;
  bool writes = true;  // false for a TP replica of a replicated weight: TP rank 0 writes it
  TensorView data;
};

// A state dict after save preprocessing: views and metadata, no tensor data of its own. A
// padding-only rank contributes no item for a parameter: nothing of it reaches the file.
struct SavePlan {
  std::vector<SaveItem> items;
  std::vector<ParamRecord> params;
  Values common;
};

// Expands factories into pieces (views of the shard's rows) and checks every shard's shape; throws
// Errc::shape_mismatch or dtype_mismatch naming the key, the rank coordinates and the rows.
SavePlan prepare_save(const StateDict& state);
// The claims of one rank, for validate_claims.
std::vector<Claim> claims_of(const SavePlan& plan, int rank);
struct LoadOptions {
  IoMethod method = IoMethod::raw;
  // Check every byte read against the checksum saved with it: a mismatch is Errc::corrupt naming
  // the file, the key and the rows. Off only to read a damaged checkpoint on purpose.
  bool verify_checksums = true;
  // Told once per load when the checkpoint predates checksums (format version 1), so its bytes
  // cannot be checked. Unset: one line on standard error (rank 0 only, in a collective load).
  std::function<void(std::string_view)> notice = {};
  // When set, the checkpoint must carry this id (CheckpointContents::id): a checkpoint that another
  // save replaced since the caller looked at it is Errc::replaced, not a silent switch.
  std::string expect_id = {};
  // Not empty (a collective load): this rank refuses its input, for the reason it says. The load's
  // first collective step carries it: every rank fails at once with Errc::invalid_argument naming
  // this rank and the reason, before anything is read. A load of one process alone throws it.
  std::string refused = {};
  // Told, on the rank that reads them, how many more bytes were read (progress reports).
  BytesDone progress = {};
  // Pinned buffers through which destinations in device memory are filled; none: the library's pool
  // for their device (device_staging: CUDA devices where the library is built with CUDA).
  std::shared_ptr<StagingPool> staging = nullptr;
  // Read tensor data around the page cache (O_DIRECT, where the file system allows it): the file's
  // pages do not crowd the page cache, and on disks where scattered reads through the page cache are
  // slow, ranks get more of the disk (what it gains where is in docs/performance.md).
  bool bypass_page_cache = false;
  // A load into new memory (load, read) gives each tensor whose bytes lie in the checkpoint as its
  // rows lie in memory (whole rows of one contiguous, unfiltered dataset of its dtype and shape: a
  // TP=1 read of a plain weight, a block, an unpadded shard, a ShardedTensor of whole rows) as a
  // private mapping of the file, checked against its checksums, rather than new memory and a copy
  // (CheckpointReader::map). False: every tensor in memory of its own (for a caller that writes
  // every byte, or must not keep the file's pages mapped).
  bool map = true;
};

// Where one rank sits in the layout a tool loads a checkpoint at.
struct LoadLayout {
  std::int64_t tp = 1;
  std::int64_t gtp = 1;
  std::int64_t align = 0;
  ShardCoord coord;
  int replica_id = 0;
  int replicas = 1;
  // Optimizer state (keys optimizer.state.*) in each DP rank's flat range (distributed_range), as a
  // distributed optimizer holds it.
  bool distributed_optimizer = false;
};
// The load request of one rank for every tensor of a global checkpoint, from the checkpoint's own
// records: each parameter record planned at the layout's TP, GTP and alignment; every dataset no
// record names as one plain parameter replicated on every TP rank, and every scalar dataset as a
// scalar ShardedTensor (the layout's DP replica of it). What a tool that knows no model
// (shardckpt load, reshard) asks for.
StateDict request_all(const CheckpointReader& reader, const LoadLayout& layout);
// Every tensor of the checkpoint at `path` in new memory, as one rank of `layout` holds it (its
// padded shards; at TP 1 x GTP 1 the whole tensors), and its common values: the request_all of the
// file, loaded (mapped where LoadOptions::map allows). What `shardckpt.read` and `shardckpt_read` do.
struct ReadAll {
  LoadedState loaded;
  // The keys of 0-d tensors (loaded as one element of shape {1}).
  std::set<std::string, std::less<>> scalars;
};
ReadAll read_all(const std::filesystem::path& path, const LoadLayout& layout, LoadOptions options = {});

// The per-rank path: a rank saves its own preprocessed state (its pieces at their local shapes) to
// its own file, and loads it back at the same layout. A padding-only rank's parameters are not in
// the file: the load rebuilds their placeholders from the request.
void save_local(const StateDict& state, const std::filesystem::path& path, IoMethod method = IoMethod::raw);
LoadedState load_local(const std::filesystem::path& path, const StateDict& request, LoadOptions options = {});
Values load_local_into(const std::filesystem::path& path, StateDict& state, LoadOptions options = {});

}  // namespace shardckpt
