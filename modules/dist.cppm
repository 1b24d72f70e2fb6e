// shardckpt.dist: many ranks, one checkpoint. A ProcessGroup offers the few collectives a save and
// a load need; ThreadGroup runs ranks as threads of one process (tests, the demo, single-process
// users), and shardckpt.dist.mpi / shardckpt.dist.nccl bring MPI and NCCL. save() gathers every
// rank's plan at rank 0, which validates them together before a byte is written, assigns every
// rank its part of the checksum table and creates the file with every dataset at its global shape;
// every rank writes its own pieces and their checksums concurrently, and rank 0 commits only when
// every rank succeeded: every rank returns the same outcome. load() opens the checkpoint once per
// rank and makes every rank agree on its id before anything is read.
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
import shardckpt.core;
import shardckpt.views;
import shardckpt.format;
import shardckpt.state;

export namespace shardckpt {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // Every rank's bytes, in rank order, on every rank.
  virtual std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) = 0;
  // Every rank's bytes, in rank order, at `root` only (the others get nothing). A save sends its
  // plans this way, so that only one rank ever holds them all; the default is an all_gather.
  virtual std::vector<std::vector<std::byte>> gather(std::span<const std::byte> mine, int root) {
    auto all = all_gather(mine);
    if (rank() != root) all.clear();
    return all;
  }
  // The root's bytes on every rank (other ranks' `bytes` are ignored).
  virtual std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) = 0;
};

// The group of one process alone.
class SoloGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void barrier() override {}
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) override;
};

// Ranks as threads of this process. Each rank uses its own endpoint, member(r). abort() makes
// every waiting and later collective throw Errc::collective, as an engine does when a peer dies.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size);
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;
  ~ThreadGroup();

  int size() const noexcept;
  ProcessGroup& member(int rank) [[clang::lifetimebound]];
  void abort(const std::string& reason);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Runs fn on `ranks` threads, one per rank of a fresh ThreadGroup. A rank that throws aborts the
// group so that the others fail instead of waiting forever; the lowest failing rank's error is
// rethrown once every thread has ended. A thread that cannot be started is Errc::collective.
void run_ranks(int ranks, const std::function<void(ProcessGroup&)>& fn);

// The steps of a save, in order, as SaveOptions::on_phase reports them on rank 0.
enum class SavePhase : std::uint8_t { planning, writing, committing, committed };
std::string_view save_phase_name(SavePhase phase) noexcept;

struct SaveOptions {
  IoMethod method = IoMethod::direct;
  // Checksum every written row (docs/format.md). Off, loads cannot check the bytes they read and
  // say so; rank 0's choice holds for the whole save.
  bool checksums = true;
  // Called on rank 0 as each phase begins (progress reports, tests that interrupt a save); must not
  // throw.
  std::function<void(SavePhase)> on_phase = {};
  // Told, on the rank that wrote them, how many more bytes were written; must not throw.
  BytesDone progress = {};
};

// Saves the state dicts of all ranks of `group` as one checkpoint at `path` (collective: every rank
// calls it). Materialization is forbidden throughout. On any failure on any rank, every rank
// throws the same error, nothing is committed and an earlier checkpoint at `path` is untouched.
// A `path` that is a symbolic link is followed: the checkpoint replaces the link's target.
void save(const StateDict& state, const std::filesystem::path& path, ProcessGroup& group, SaveOptions options = {});
void save(const StateDict& state, const std::filesystem::path& path, SaveOptions options = {});

// Every rank loads its own part at its own layout, concurrently; every rank gets the same outcome.
// Each rank opens the checkpoint once, and all ranks must have opened the same one (the same
// checkpoint id): a path replaced between two ranks' opens is Errc::replaced, never a mix.
LoadedState load(const std::filesystem::path& path, const StateDict& request, ProcessGroup& group,
                 LoadOptions options = {});

}  // namespace shardckpt
