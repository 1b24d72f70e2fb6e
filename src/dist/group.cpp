module;
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.storage;
import shardckpt.state;
import shardckpt.merge;
import :wire;
import :protocol;

namespace shardckpt {

std::vector<std::vector<std::byte>> ProcessGroup::gather(std::span<const std::byte> mine, int root) {
  require_root(root, size());
  auto all = all_gather(mine);
  if (rank() != root) all.clear();
  return all;
}

ProcessGroup& Replicas::group() const {
  require(group_ != nullptr, Errc::internal, "no replica group");
  return *group_;
}

void require_root(int root, int size) {
  require(root >= 0 && root < size, Errc::invalid_argument, "root ", root, " is outside a group of ", size);
}

void require_row_counts(TensorView rows, std::span<const std::int64_t> counts, int size) {
  require(counts.size() == static_cast<std::size_t>(size), Errc::invalid_argument, "gathering rows: ", counts.size(),
          " row counts for a group of ", size);
  std::int64_t total = 0;
  for (std::int64_t c : counts) {
    require(c >= 0, Errc::invalid_argument, "gathering rows: a negative row count (", c, ")");
    total = checked_add(total, c, "rows gathered");
  }
  require(total == rows.rows(), Errc::invalid_argument, "gathering rows: the counts add up to ", total,
          " rows but the tensor has ", rows.rows());
}

std::unique_ptr<ProcessGroup> SoloGroup::split(int, int) { return std::make_unique<SoloGroup>(); }

void SoloGroup::all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) {
  require_row_counts(rows, counts, 1);
}

std::vector<std::vector<std::byte>> SoloGroup::all_gather(std::span<const std::byte> mine) {
  return {Bytes(mine.begin(), mine.end())};
}

std::vector<std::byte> SoloGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require_root(root, 1);
  return {bytes.begin(), bytes.end()};
}

// The rendezvous of a thread group's members, one collective at a time: the last member to arrive
// publishes the round's result and bumps the generation that the others wait on. Groups split from
// it are its children: an abort reaches them too.
struct ThreadGroup::Shared {
  explicit Shared(int size) : size(size), slots(static_cast<std::size_t>(size)) {}

  const int size;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Bytes> slots, result;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::optional<std::string> aborted;
  std::vector<std::weak_ptr<Shared>> children;
  // Groups being split off in one round, by (round, color): the group and how many members have yet
  // to take it.
  std::map<std::pair<std::uint64_t, int>, std::pair<std::shared_ptr<Shared>, int>> splitting;

  void abort(const std::string& reason) {
    std::vector<std::shared_ptr<Shared>> reached;
    {
      const std::lock_guard lock(mutex);
      if (!aborted) aborted = reason;
      changed.notify_all();
      for (const auto& c : children)
        if (auto child = c.lock()) reached.push_back(std::move(child));
    }
    for (const auto& child : reached) child->abort(reason);
  }

  void throw_if_aborted() const {
    if (aborted) throw Error(Errc::collective, cat("the thread group was aborted: ", *aborted));
  }

  // Deposits this member's bytes, waits for the round to complete, and returns pick(result, round)
  // for this member: everything, one member's bytes, or nothing.
  template <class Pick>
  auto exchange(int me, std::span<const std::byte> mine, Pick pick) {
    std::unique_lock lock(mutex);
    throw_if_aborted();
    slots[static_cast<std::size_t>(me)].assign(mine.begin(), mine.end());
    if (++arrived == size) {
      result = std::move(slots);
      slots.assign(static_cast<std::size_t>(size), {});
      arrived = 0;
      ++generation;
      changed.notify_all();
      return pick(result, generation);
    }
    const std::uint64_t round = generation;
    changed.wait(lock, [&] { return generation != round || aborted; });
    if (generation == round) throw_if_aborted();
    // The next round cannot complete without this member, so `result` still holds this round's.
    return pick(result, round + 1);
  }

  // The group of `color` split off in `round`, made by the first of its `members` to ask.
  std::shared_ptr<Shared> child(std::uint64_t round, int color, int members) {
    const std::lock_guard lock(mutex);
    throw_if_aborted();
    auto [it, fresh] = splitting.try_emplace({round, color});
    if (fresh) {
      it->second = {std::make_shared<Shared>(members), members};
      std::erase_if(children, [](const std::weak_ptr<Shared>& c) { return c.expired(); });
      children.push_back(it->second.first);
    }
    std::shared_ptr<Shared> out = it->second.first;
    if (--it->second.second == 0) splitting.erase(it);
    return out;
  }
};

namespace {

class ThreadMember final : public ProcessGroup {
 public:
  ThreadMember(std::shared_ptr<ThreadGroup::Shared> shared, int me) : shared_(std::move(shared)), me_(me) {}

  int rank() const override { return me_; }
  int size() const override { return shared_->size; }
  bool threads_of_one_process() const override { return true; }
  void barrier() override {
    shared_->exchange(me_, {}, [](std::vector<Bytes>&, std::uint64_t) { return 0; });
  }

  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    Writer w;
    w.i64(color);
    w.i64(key);
    std::uint64_t round = 0;
    const auto all = shared_->exchange(me_, w.take(), [&](std::vector<Bytes>& r, std::uint64_t g) {
      round = g;
      return r;
    });
    // Members of my color, ordered by key and then by rank in this group.
    std::vector<std::pair<std::int64_t, int>> mine;
    for (int r = 0; r < size(); ++r) {
      Reader in(all[static_cast<std::size_t>(r)]);
      const std::int64_t c = in.i64();
      if (c == color) mine.emplace_back(in.i64(), r);
    }
    std::sort(mine.begin(), mine.end());
    const auto me = std::find_if(mine.begin(), mine.end(), [&](const auto& m) { return m.second == me_; });
    return std::make_unique<ThreadMember>(shared_->child(round, color, static_cast<int>(mine.size())),
                                          static_cast<int>(me - mine.begin()));
  }

  // Each member publishes where its rows are; each then copies the other members' shares out of
  // their memory into its own, and none returns before all have copied.
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override {
    // The counts travel as a digest: every member holds every member's payload, so a payload that
    // grew with the group (the counts themselves) would cost memory that grows with its square.
    const auto digest_of_counts = [&] { return static_cast<std::int64_t>(digest(std::as_bytes(counts))); };
    Writer w;
    w.i64(static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(rows.data())));
    w.i64(static_cast<std::int64_t>(rows.row_bytes()));
    w.i64(static_cast<std::int64_t>(counts.size()));
    w.i64(digest_of_counts());
    // Gathered at member 0 and told to all as one buffer: an all_gather would hand every member a
    // vector of every member's payload (allocations that grow with the square of the group).
    const auto gathered = gather(checked(
        [&] {
          require_row_counts(rows, counts, size());
          require(rows.space().host_accessible(), Errc::invalid_argument, "a thread group moves host memory, not ",
                  memory_space_text(rows.space()), " memory");
        },
        w.take()), 0);
    Bytes joined;
    if (me_ == 0)
      joined = outcome([&] {
        Writer all;
        for (std::span<const std::byte> p : payloads_or_throw("gathering rows", gathered)) all.bytes(p);
        return all.take();
      });
    const Bytes told = broadcast(joined, 0);
    Reader in(payload_or_throw(told));
    std::int64_t start = 0;
    for (int r = 0; r < size(); ++r) {
      const auto* from = reinterpret_cast<const std::byte*>(static_cast<std::uintptr_t>(in.i64()));
      const std::int64_t row_bytes = in.i64();
      const std::int64_t n_counts = in.i64();
      require(row_bytes == static_cast<std::int64_t>(rows.row_bytes()) &&
                  n_counts == static_cast<std::int64_t>(counts.size()) && in.i64() == digest_of_counts(),
              Errc::invalid_argument, "gathering rows: member ", r, " gathers rows of ", row_bytes, " bytes, member ",
              me_, " of ", rows.row_bytes(), " bytes, or with other counts");
      const std::int64_t n = counts[static_cast<std::size_t>(r)];
      if (r != me_ && n > 0)
        io::copy_guarded(rows.slice_rows(start, start + n).data(), from + start * row_bytes,  // `from` may be a mapping
                         static_cast<std::size_t>(n * row_bytes));
      start += n;
    }
    barrier();
  }

  Bytes broadcast(std::span<const std::byte> bytes, int root) override {
    require_root(root, size());
    return shared_->exchange(me_, me_ == root ? bytes : std::span<const std::byte>(),
                             [&](std::vector<Bytes>& all, std::uint64_t) { return all[static_cast<std::size_t>(root)]; });
  }

 protected:
  std::vector<Bytes> all_gather(std::span<const std::byte> mine) override {
    return shared_->exchange(me_, mine, [](std::vector<Bytes>& all, std::uint64_t) { return all; });
  }
  std::vector<Bytes> gather(std::span<const std::byte> mine, int root) override {
    require_root(root, size());
    // Only the root reads the round's result, so it may take it.
    return shared_->exchange(me_, mine, [&](std::vector<Bytes>& all, std::uint64_t) {
      return me_ == root ? std::move(all) : std::vector<Bytes>();
    });
  }

 private:
  std::shared_ptr<ThreadGroup::Shared> shared_;
  int me_;
};

}  // namespace

ThreadGroup::ThreadGroup(int size) {
  require(size >= 1, Errc::invalid_argument, "a thread group needs at least one rank (got ", size, ")");
  shared_ = std::make_shared<Shared>(size);
  for (int r = 0; r < size; ++r) members_.push_back(std::make_unique<ThreadMember>(shared_, r));
}

ThreadGroup::~ThreadGroup() = default;

int ThreadGroup::size() const noexcept { return shared_->size; }

ProcessGroup& ThreadGroup::member(int rank) {
  require(rank >= 0 && rank < size(), Errc::invalid_argument, "rank ", rank, " is outside a thread group of ", size());
  return *members_[static_cast<std::size_t>(rank)];
}

void ThreadGroup::abort(const std::string& reason) { shared_->abort(reason); }

void run_ranks(int ranks, const std::function<void(ProcessGroup&)>& fn) {
  ThreadGroup group(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  std::optional<Error> not_started;
  for (int r = 0; r < ranks && !not_started; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          fn(group.member(r));
        } catch (const std::bad_alloc&) {
          errors[static_cast<std::size_t>(r)] =
              std::make_exception_ptr(Error(Errc::resources, cat("rank ", r, " ran out of memory")));
          group.abort(cat("rank ", r, " ran out of memory"));
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          group.abort(cat("rank ", r, " failed: ", e.what()));
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          group.abort(cat("rank ", r, " failed"));
        }
      });
    } catch (const std::exception& e) {  // no thread for this rank: the started ones must not wait for it
      not_started.emplace(Errc::collective, cat("could not start the thread of rank ", r, " of ", ranks, ": ", e.what()));
      group.abort(not_started->what());
    }
  }
  for (std::thread& t : threads) t.join();
  if (not_started) throw *not_started;
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

std::string_view save_phase_name(SavePhase phase) noexcept {
  switch (phase) {
    case SavePhase::planning:
      return "planning";
    case SavePhase::writing:
      return "writing";
    case SavePhase::committing:
      return "committing";
    case SavePhase::committed:
      return "committed";
  }
  return "?";
}

}  // namespace shardckpt
