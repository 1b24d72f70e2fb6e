// shardckpt.dist:group: process groups, the few collectives a save and a load need. ThreadGroup runs
// ranks as threads of one process (tests, the demo, single-process users); shardckpt.dist.mpi and
// shardckpt.dist.nccl bring MPI and NCCL. Metadata moves as bytes through the protected collectives,
// which only the library calls; tensor rows move in place (all_gather_rows), never gathered whole.
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
export module shardckpt.dist:group;
import shardckpt.core;
import shardckpt.views;

export namespace shardckpt {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // A new group of the members that pass the same `color`, ranked by `key` (collective).
  virtual std::unique_ptr<ProcessGroup> split(int color, int key) = 0;
  // In place: member i fills counts[i] consecutive rows of `rows` (in member order), and every
  // member ends with all of them. No memory is allocated for the tensor; `rows` must be memory the
  // group moves (host memory for threads and MPI, device memory for NCCL).
  virtual void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) = 0;
  // The root's bytes on every rank (other ranks' `bytes` are ignored): metadata.
  virtual std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) = 0;
  // Whether all_gather_rows can move memory of `space`.
  virtual bool moves(MemorySpace space) const { return space.host_accessible(); }
  // Whether a thread may run collectives on this group while other threads use other groups of
  // the same process (what an async save does).
  virtual bool supports_background() const { return true; }
  // Whether every member is a thread of this process (they may then share objects, such as one open
  // checkpoint, instead of each holding its own).
  virtual bool threads_of_one_process() const { return false; }

 protected:
  // Every rank's bytes, in rank order, on every rank (or at `root` only), for the library's
  // protocols: metadata, never tensors (gathering tensor bytes would build a full tensor).
  virtual std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) = 0;
  virtual std::vector<std::vector<std::byte>> gather(std::span<const std::byte> mine, int root);
  // The same on another group, for groups that wrap one (fault injection, logging).
  static std::vector<std::vector<std::byte>> all_gather_of(ProcessGroup& g, std::span<const std::byte> mine) {
    return g.all_gather(mine);
  }
  static std::vector<std::vector<std::byte>> gather_of(ProcessGroup& g, std::span<const std::byte> mine, int root) {
    return g.gather(mine, root);
  }
  friend struct Protocol;
};

// The group of a rank's data-parallel copies over which a load splits its reads, or none. It refers to
// a group its caller keeps (made from a named group, as a reference binds; not from a temporary one),
// and holds no pointer a caller could hand it.
class Replicas {
 public:
  Replicas() = default;
  Replicas(ProcessGroup& group) noexcept : group_(&group) {}  // implicit: load_into(..., group, {}, replicas)
  Replicas(ProcessGroup&&) = delete;
  explicit operator bool() const noexcept { return group_ != nullptr; }
  // Throws Errc::internal when there is none.
  ProcessGroup& group() const;

 private:
  ProcessGroup* group_ = nullptr;
};

// Throws Errc::invalid_argument unless 0 <= root < size.
void require_root(int root, int size);
// Throws Errc::invalid_argument unless `counts` has one entry per member and adds up to `rows`.
void require_row_counts(TensorView rows, std::span<const std::int64_t> counts, int size);

// The group of one process alone.
class SoloGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  bool threads_of_one_process() const override { return true; }
  void barrier() override {}
  std::unique_ptr<ProcessGroup> split(int color, int key) override;
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override;
  std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) override;

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
};

// Ranks as threads of this process. Each rank uses its own endpoint, member(r). abort() makes
// every waiting and later collective throw Errc::collective, in this group and the groups split from
// it, as an engine does when a peer dies.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size);
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;
  ~ThreadGroup();

  int size() const noexcept;
  ProcessGroup& member(int rank) [[clang::lifetimebound]];
  void abort(const std::string& reason);

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<ProcessGroup>> members_;
};

// Runs fn on `ranks` threads, one per rank of a fresh ThreadGroup. A rank that throws aborts the
// group so that the others fail instead of waiting forever; the lowest failing rank's error is
// rethrown once every thread has ended. A thread that cannot be started is Errc::collective.
void run_ranks(int ranks, const std::function<void(ProcessGroup&)>& fn);

}  // namespace shardckpt
