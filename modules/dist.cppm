// shardckpt.dist: many ranks, one checkpoint. A ProcessGroup offers the few collectives a save and
// a load need; ThreadGroup runs ranks as threads of one process (tests, the demo, single-process
// users), and shardckpt.dist.mpi / shardckpt.dist.nccl bring MPI and NCCL. save() gathers every
// rank's plan at rank 0, which validates them together before a byte is written, assigns every
// rank its part of the checksum table and creates the file with every dataset at its global shape;
// every rank writes its own pieces and their checksums concurrently, and rank 0 commits only when
// every rank succeeded: every rank returns the same outcome. load() opens the checkpoint once per
// rank and makes every rank agree on it before anything is read; data-parallel copies of a shard
// read it once between them and hand each other the rows. A Saver keeps what repeated saves need
// (the bounded host memory of async saves, a pool of pinned buffers cut from it, a private group).
// It never moves tensor rows through a gather and never reads or writes a file itself: rows go
// from each rank's memory to its own part of the file through shardckpt.storage.
module;
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>
export module shardckpt.dist;
export import :group;
import shardckpt.core;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.storage;
import shardckpt.state;
import shardckpt.merge;

export namespace shardckpt {

// The steps of a save, in order, as SaveOptions::on_phase reports them on rank 0.
enum class SavePhase : std::uint8_t { planning, writing, committing, committed };
std::string_view save_phase_name(SavePhase phase) noexcept;

struct SaveOptions {
  IoMethod method = IoMethod::raw;
  // Checksum every written row (docs/format.md). Off, loads cannot check the bytes they read and
  // say so; rank 0's choice holds for the whole save.
  bool checksums = true;
  // Called on rank 0 as each phase begins (progress reports, tests that interrupt a save); must not
  // throw.
  std::function<void(SavePhase)> on_phase = {};
  // Told, on the rank that wrote them, how many more bytes were written; must not throw.
  BytesDone progress = {};
  // Pinned buffers through which shards in device memory are written; none: the library's pool for
  // their device (device_staging). A Saver with an engine brings its own.
  std::shared_ptr<StagingPool> staging = nullptr;
  // A `path` that is a symbolic link is followed (the checkpoint replaces the link's target). False,
  // for a name the caller fixes rather than the user (a backend's file in a directory another user
  // could write to): a link there is refused, Errc::invalid_argument naming it, and nothing is written.
  bool follow_links = true;
  // Not empty: this rank refuses its input, for the reason it says (a front end's check that failed
  // before the save, on this rank alone). The save's first collective step carries it, so every rank
  // fails at once with Errc::invalid_argument naming this rank and the reason, and nothing is
  // written: no rank waits on another's refusal, and the vote costs no round of its own.
  std::string refused = {};
};

// Saves the state dicts of all ranks of `group` as one checkpoint at `path` (collective: every rank
// calls it). Materialization is forbidden throughout. On any failure on any rank, every rank
// throws the same error, nothing is committed and an earlier checkpoint at `path` is untouched.
// A `path` that is a symbolic link is followed: the checkpoint replaces the link's target (unless
// SaveOptions::follow_links is false).
void save(const StateDict& state, const std::filesystem::path& path, ProcessGroup& group, SaveOptions options = {});
void save(const StateDict& state, const std::filesystem::path& path, SaveOptions options = {});

// One process alone: load_into fills the tensors of `state` where they are (host or device memory):
// each piece straight into its destination rows, pad rows zeroed in place, a padding-only rank's
// shard zero-filled; it allocates nothing proportional to the model and returns the common and local
// values. load allocates (or maps, LoadOptions::map) host memory for a request at any TP, GTP and
// alignment, then fills it; a tensor asked for whole (a ShardedTensor at its global shape, a
// parameter at GTP 1 that TP does not split) is counted as a materialization, a scalar is not.
// Throws Errc::missing_key, shape_mismatch, dtype_mismatch, not_a_checkpoint or corrupt; Errc::layout,
// before anything is read, when a parameter's TP does not divide the heads or groups its record
// names (require_tp_divides).
Values load_into(const std::filesystem::path& path, StateDict& state, LoadOptions options = {});
Values load_into(const CheckpointReader& reader, StateDict& state, LoadOptions options = {});
LoadedState load(const std::filesystem::path& path, const StateDict& request, LoadOptions options = {});
LoadedState load(const CheckpointReader& reader, const StateDict& request, LoadOptions options = {});

// The same on every rank of `group`: every rank loads its own part at its own layout, concurrently;
// every rank gets the same outcome. Each rank opens the checkpoint once (ranks that are threads of one
// process share one open reader), and all ranks must have opened the same one: a path replaced between
// two ranks' opens is Errc::replaced, never a mix. With `replicas` (this rank's group of data-parallel
// copies, ranked by replica id), the copies of a shard each read a share of its rows from the file and
// receive the others' through the group: each byte is read once per group.
Values load_into(const std::filesystem::path& path, StateDict& state, ProcessGroup& group,
                 LoadOptions options = {}, Replicas replicas = {});
LoadedState load(const std::filesystem::path& path, const StateDict& request, ProcessGroup& group,
                 LoadOptions options = {}, Replicas replicas = {});
// Opens the checkpoint at `path` on every rank of `group` (collective), as the loads above do: rank 0
// checks the whole seal of its metadata and the others only that theirs has that seal; ranks that
// are threads of one process share rank 0's reader. Every rank gets the reader or the same error.
// A load through it (below) reads its tensors from that open file, whatever is at `path` by then.
std::shared_ptr<const CheckpointReader> open_checkpoint(const std::filesystem::path& path, ProcessGroup& group);
// The same through a checkpoint each rank has open already (thread ranks may share one reader):
// records, common values and tensor bytes then come from that one open file, and the ranks check
// that their readers hold the same checkpoint (CheckpointReader::fingerprint) before anything is read.
Values load_into(const CheckpointReader& reader, StateDict& state, ProcessGroup& group, LoadOptions options = {},
                 Replicas replicas = {});
LoadedState load(const CheckpointReader& reader, const StateDict& request, ProcessGroup& group,
                 LoadOptions options = {}, Replicas replicas = {});

// A save in the background (Saver::save_async), with two points in its life: staged (every byte this
// rank saves has left its shards, so the caller may change them) and done (committed on every rank,
// or failed on every rank). Any thread may wait for either.
class AsyncSave {
 public:
  AsyncSave() = default;
  AsyncSave(AsyncSave&&) noexcept;
  AsyncSave& operator=(AsyncSave&&) noexcept;
  ~AsyncSave();
  // Returns once every byte this rank saves has left its shards (copied into the saver's budget, or
  // written to the file), or once the save has ended: from then on the shards may change (a trainer
  // calls it just before its optimizer step). It reports no error; wait() does.
  void wait_staged();
  bool staged() const;
  // Returns once the save has ended, with its collective outcome (the same on every rank), or throws it.
  void wait();
  bool done() const;

  struct State;

 private:
  friend class Saver;
  explicit AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

struct SaverOptions {
  // The engine of the device the shards live on. None: device shards go through the library's pool
  // for their device (device_staging), except in an async save staged whole or checked with
  // check_unchanged (Errc::invalid_argument).
  std::shared_ptr<CopyEngine> engine = nullptr;
  // The pool of pinned buffers device rows stream through (staging_buffers of staging_buffer_bytes).
  std::size_t staging_buffer_bytes = StagingPool::default_buffer_bytes;
  int staging_buffers = 2;
  // The host memory async saves may use: pinned memory of the engine's (locked host memory without
  // one), allocated once and never grown; 0 (or anything below the pool): the pool's size. The pool's
  // buffers are cut from it, as many as fit. A rank whose bytes fit it (each piece rounded up to 64
  // bytes) is staged whole before save_async returns; a larger one streams through it afterwards.
  std::size_t async_host_bytes = 0;
  // A debug check: save_async hashes every row each piece saves, and every row is hashed again as it
  // is staged; a row that differs fails the save with Errc::shard_changed naming the key and rows.
  // It costs save_async one read of every byte (device rows through the pool) and 8 bytes a row.
  bool check_unchanged = false;
  // The budget allocated and every page of it faulted in when the saver is made, so that no
  // save_async allocates or waits for the kernel to back its memory (the first one included). False:
  // at reserve(), or else by the first async save staged whole (which then waits for it).
  bool reserve = true;
  SaveOptions save = {};
};

// Repeated saves of one rank (collective to make: every rank of the group makes one). It holds,
// allocated once and reused: the budget of async saves, a pool of pinned buffers cut from it through
// which device shards stream to the file (copying the next buffer while the current one is written),
// and a private copy of the group, so that a save in the background never mixes its messages with
// the caller's collectives. One save at a time: a save first waits for the one in flight to end.
class Saver {
 public:
  Saver(ProcessGroup& group, SaverOptions options = {});
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;
  ~Saver();

  void save(const StateDict& state, const std::filesystem::path& path);
  // Plans this rank's pieces (no collective) and returns. When this rank's bytes fit the budget they
  // are staged before it returns (the AsyncSave is staged at once); otherwise it returns before any
  // byte is copied, and they stream from the shards through the budget to the file in the background:
  // the caller must not change its shards until AsyncSave::wait_staged() returns. Planning with the
  // other ranks, writing, syncing and the commit run in the background, on the saver's group. The
  // saver keeps the state dict's shards alive until the save has read them (a borrowed shard must be
  // kept alive by its owner until then). Errors of this rank's planning are the save's collective
  // error (AsyncSave::wait).
  AsyncSave save_async(const StateDict& state, const std::filesystem::path& path);
  // The budget of async saves: SaverOptions::async_host_bytes, never less than the pool.
  std::size_t async_host_bytes() const;
  // Allocates the budget and faults in every page of it, if the saver does not hold it yet (made
  // with reserve = false); this rank alone (not collective). Errc::resources when the memory is not
  // there.
  void reserve();
  // Pinned memory this saver holds: its budget from the moment it is made (or from reserve(), or
  // the first async save staged whole, with reserve = false; a saver with an engine always holds
  // it: the pool lies in it).
  std::size_t staging_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardckpt

// For the units of this module, not exported: a save of the plan that `make_plan` returns on each
// rank (called once, in the planning phase, so that its errors are the save's collective errors);
// `staged` is told as the rows of the plan's items leave the memory they view.
namespace shardckpt {
void save_with(const std::function<SavePlan()>& make_plan, const std::filesystem::path& path, ProcessGroup& group,
               const SaveOptions& options,
               const std::function<void(std::size_t, std::int64_t, TensorView)>& staged = {});  // RowsStaged
}  // namespace shardckpt
