// shardckpt.merge.seam (a module of the library's own, never installed): the seam between merge and
// the collective save and load of shardckpt.dist. What dist needs of a rank's state dict and no user
// calls: the plan of a save and the write of its items, a load with the reads of data-parallel copies
// split, the destinations of a load and their checks, the memory a load into new tensors takes, and
// the pieces (views of a shard's rows at their dataset boxes) that the save and the load share.
module;
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>
export module shardckpt.merge.seam;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;
import shardckpt.merge;
export import :pieces;

export namespace shardckpt {

// The plan of a save: `share_replicas`: data-parallel copies each write a balanced share (a rank's
// own local file holds all it has).
SavePlan plan_save(const StateDict& state, bool share_replicas);

// Told, as rows of item `item` of a plan leave the memory the item views (copied into a staging
// buffer, or written from host memory), which rows they are: `rows` holds rows [first_row,
// first_row + rows.rows()) of the item as they were read, in host memory. Device rows are told once
// their copy has landed and before they are written; host rows once written. Items in plan order.
using RowsStaged = std::function<void(std::size_t item, std::int64_t first_row, TensorView rows)>;
// Writes this rank's items, in order, into a skeleton whose datasets are `datasets` (in key order, as
// the skeleton lists them; each item's found once, before a byte is written). Items in device memory
// go through `staging` (none: the library's pool for their device): while one buffer's rows are
// written, the engine copies the next.
void write_items(const SavePlan& plan, std::span<const Dataset> datasets, PieceWriter& writer,
                 const std::shared_ptr<StagingPool>& staging = nullptr, const RowsStaged& staged = {});

// Fills the tensors of `state` where they are (host or device memory) from `reader`, a checkpoint of
// `kind` (the global path or the per-rank local one): each piece straight into its destination rows,
// pad rows zeroed in place, a padding-only rank's shard zero-filled. Allocates nothing proportional
// to the model. Returns the common and local values. With `read_own_share`, each data-parallel copy
// of a shard reads only its share of the rows (the others then arrive through the replicas' group:
// replica_rows). Throws Errc::missing_key, shape_mismatch, dtype_mismatch, not_a_checkpoint or
// corrupt; Errc::layout, before anything is read, when a parameter's TP does not divide the heads or
// groups its record names (require_tp_divides).
Values load_with(const CheckpointReader& reader, StateDict& state, const LoadOptions& options, CheckpointKind kind,
                 bool read_own_share = false);
// Loads this rank's part of a global checkpoint at the request's layout into memory it maps or
// allocates (map_or_allocate, every entry), then fills it (load_with).
LoadedState load_new(const CheckpointReader& reader, const StateDict& request, const LoadOptions& options);
// Tells LoadOptions::notice (or standard error) that the checkpoint's bytes or metadata are read
// unchecked, if they are.
void notice_unchecked(const CheckpointReader& reader, const LoadOptions& options);

// The rows the data-parallel copies of one shard hand each other after a load that split its reads
// (load_with's read_own_share): `rows` holds data, replica i read counts[i] of them, in order.
struct ReplicaRows {
  MutTensorView rows;
  std::vector<std::int64_t> counts;
};
std::vector<ReplicaRows> replica_rows(StateDict& state);

// Several ranks that are threads of one process (`thread_ranks`) call HDF5 at once, which needs an
// HDF5 built thread-safe (Debian's is: one global lock): Errc::invalid_argument when `thread_safe` is
// false. Every collective save and load checks it first.
void require_thread_safe_hdf5(bool thread_ranks, bool thread_safe = hdf5_thread_safe());

// The memory a load writes of one entry of a state dict: where it is and whose it is.
struct LoadTarget {
  std::string key;
  MemorySpace space;
  std::uintptr_t begin = 0, end = 0;  // addresses in `space`
};
// Every destination of a load into `state`, each checked before a byte is read: present, of its
// entry's dtype and shape, and writable (Errc::shape_mismatch, Errc::invalid_argument naming the key).
std::vector<LoadTarget> load_targets(StateDict& state);
// Throws Errc::invalid_argument naming both keys when two destinations share memory: a load would
// fill one entry with another's rows (`who` says whose they are: a rank, or ranks of one process).
void require_disjoint(std::vector<LoadTarget> targets, std::string_view who);

// The request's host-memory twin: the same entries with destinations that a load allocates.
struct Allocated {
  StateDict state;
  std::map<std::string, SharedBuffer, std::less<>> buffers;
};
Allocated allocate_destinations(const StateDict& request);
// The same after mapping what can be (LoadOptions::map, CheckpointReader::map): `state` holds the
// entries still to load (load_with), `buffers` every entry's tensor, mapped or allocated. Entries
// whose rows replicas share (replicas > 1) are mapped only when `shared_too` (a collective load reads
// them in shares instead).
Allocated map_or_allocate(const CheckpointReader& reader, const StateDict& request, const LoadOptions& options,
                          bool shared_too);

}  // namespace shardckpt
