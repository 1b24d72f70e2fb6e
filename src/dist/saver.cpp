module;
#include <sys/resource.h>
#include <unistd.h>

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
import shardckpt.merge.seam;
import :wire;
import :protocol;
import :staging;

namespace shardckpt {
namespace {
namespace fs = std::filesystem;

// A budget this process can never hold fails when the saver is made (Errc::resources naming the
// budget and the limit), not at the first save that maps and locks it: that would touch every page
// of it (locking faults them in) or take the machine's memory until the OOM killer comes, or fail
// as a mapping error. The limits: physical memory, and the address space and data limits a mapping
// counts against. Locked memory beyond RLIMIT_MEMLOCK stays pageable (allocate_locked: best effort).
void require_budget_fits(std::size_t budget) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) {
    const auto physical = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
    require(budget <= physical, Errc::resources, "a saver's host budget of ", budget,
            " bytes (async_host_bytes, never less than its pool of staging buffers) is more than the ", physical,
            " bytes of this machine's physical memory");
  }
  for (const auto& [resource, name] :
       {std::pair{RLIMIT_AS, "RLIMIT_AS (address space)"}, std::pair{RLIMIT_DATA, "RLIMIT_DATA"}}) {
    rlimit limit{};
    if (::getrlimit(resource, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) continue;
    require(budget <= limit.rlim_cur, Errc::resources, "a saver's host budget of ", budget,
            " bytes (async_host_bytes, never less than its pool of staging buffers) is more than this process's ",
            name, " limit of ", static_cast<std::uint64_t>(limit.rlim_cur), " bytes");
  }
}

}  // namespace

// ---- async saves -------------------------------------------------------------------------------

struct AsyncSave::State {
  mutable std::mutex mutex;
  std::condition_variable changed;
  bool staged = false, finished = false;
  std::exception_ptr error;

  void mark_staged() {
    const std::lock_guard lock(mutex);
    staged = true;
    changed.notify_all();
  }
  void finish(std::exception_ptr e) {
    const std::lock_guard lock(mutex);
    error = std::move(e);
    staged = finished = true;
    changed.notify_all();
  }
};

AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;
AsyncSave& AsyncSave::operator=(AsyncSave&&) noexcept = default;
AsyncSave::~AsyncSave() = default;

void AsyncSave::wait_staged() {
  require(state_ != nullptr, Errc::invalid_argument, "waiting for no save");
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return state_->staged; });
}

bool AsyncSave::staged() const {
  if (!state_) return false;
  const std::lock_guard lock(state_->mutex);
  return state_->staged;
}

void AsyncSave::wait() {
  require(state_ != nullptr, Errc::invalid_argument, "waiting for no save");
  std::unique_lock lock(state_->mutex);
  state_->changed.wait(lock, [&] { return state_->finished; });
  if (state_->error) std::rethrow_exception(state_->error);
}

bool AsyncSave::done() const {
  if (!state_) return false;
  const std::lock_guard lock(state_->mutex);
  return state_->finished;
}

namespace {

// One async save, as the caller's thread leaves it to the background.
struct AsyncJob {
  SavePlan plan;
  std::exception_ptr error;            // this rank's failure before the background began: its planning error
  std::optional<StateDict> shards;     // a streamed save keeps the shards' owners until it ends
  std::optional<UnchangedCheck> check;
  std::size_t unstaged = 0;            // bytes still to leave the shards
};

}  // namespace

struct Saver::Impl {
  SaverOptions options;
  std::size_t budget = 0;
  std::unique_ptr<ProcessGroup> group;  // private: background saves never meet the caller's collectives
  SharedBuffer memory;                  // the budget; the pool's buffers lie in it
  std::shared_ptr<StagingPool> pool;
  std::thread background;

  SaveOptions save_options() const {
    SaveOptions o = options.save;
    if (pool) o.staging = pool;
    return o;
  }

  // The previous save, if one runs, must end before the next begins.
  void join() {
    if (background.joinable()) background.join();
  }

  // Pinned memory of the engine's (locked host memory without an engine) for the budget; a mapping
  // the kernel refuses (the address space or memory left) is the budget's Errc::resources.
  void allocate_budget() {
    const Extents shape{static_cast<std::int64_t>(budget)};
    try {
      memory = options.engine ? options.engine->allocate_pinned(DType::u8, shape) : allocate_locked(DType::u8, shape);
    } catch (const Error& e) {
      if (e.code() != Errc::internal && e.code() != Errc::resources) throw;
      throw Error(Errc::resources,
                  cat("a saver's host budget of ", budget, " bytes could not be allocated: ", e.what()));
    }
    if (options.engine) pool = std::make_shared<StagingPool>(options.engine, memory, options.staging_buffer_bytes);
  }

  // After a failed save: no copy it enqueued may still land in the budget when the next one uses it.
  void settle() noexcept {
    if (!options.engine) return;
    try {
      options.engine->wait(options.engine->fence());
    } catch (...) {  // the save's own error is the one reported
    }
  }

  // The caller's part of an async save: plans this rank's pieces and, when they fit the budget, stages
  // them whole; otherwise keeps the shards' owners for the background, which streams them.
  void prepare(const StateDict& state, AsyncJob& job) {
    job.plan = prepare_save(state);
    if (options.check_unchanged) job.check.emplace(job.plan, pool.get());
    if (whole_staging_bytes(job.plan) <= budget) {
      if (!memory) allocate_budget();  // a saver without an engine: its first async save staged whole
      job.plan = stage_whole(std::move(job.plan), memory.mut_view(), options.engine.get());
      if (job.check) job.check->verify_all(job.plan);
      job.check.reset();
      return;
    }
    job.shards = state;
    job.unstaged = written_bytes(job.plan);
  }

  // The background's part: the collective save of the job's plan; a streamed one tells `outcome` when
  // its last byte has left the shards, after checking each row staged when asked to.
  void run(AsyncJob& job, AsyncSave::State& outcome, const fs::path& path) {
    const auto staged = [&](std::size_t item, std::int64_t first, TensorView rows) {
      if (job.check) job.check->verify(item, first, rows);
      job.unstaged -= std::min(job.unstaged, rows.bytes());
      if (job.unstaged == 0) outcome.mark_staged();
    };
    try {
      save_with(
          [&] {
            if (job.error) std::rethrow_exception(job.error);
            return std::move(job.plan);
          },
          path, *group, save_options(), staged);
      job.shards.reset();
      outcome.finish(nullptr);
    } catch (...) {
      settle();
      job.shards.reset();
      outcome.finish(std::current_exception());
    }
  }
};

Saver::Saver(ProcessGroup& group, SaverOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->group = group.split(0, group.rank());
  agree(*impl_->group, "making a saver", [&] {
    const SaverOptions& o = impl_->options;
    require(o.staging_buffers >= 1 && o.staging_buffer_bytes > 0, Errc::invalid_argument,
            "a saver's pool needs at least one buffer of at least one byte (got ", o.staging_buffers, " of ",
            o.staging_buffer_bytes, ")");
    const auto pool_bytes = static_cast<std::size_t>(checked_mul(
        o.staging_buffers, static_cast<std::int64_t>(o.staging_buffer_bytes), "the saver's pool in bytes"));
    impl_->budget = std::max(o.async_host_bytes, pool_bytes);
    require_budget_fits(impl_->budget);
    if (o.engine || o.reserve) impl_->allocate_budget();
  });
}

// The budget is only ever touched by the caller's thread (a save in flight without it streams from
// the shards, and a saver with a pool, which the background uses, always holds its budget).
void Saver::reserve() {
  if (!impl_->memory) impl_->allocate_budget();
}

Saver::~Saver() { impl_->join(); }

void Saver::save(const StateDict& state, const fs::path& path) {
  impl_->join();
  try {
    shardckpt::save(state, path, *impl_->group, impl_->save_options());
  } catch (...) {
    impl_->settle();
    throw;
  }
}

AsyncSave Saver::save_async(const StateDict& state, const fs::path& path) {
  impl_->join();
  require(impl_->group->supports_background(), Errc::invalid_argument,
          "this process group cannot run a save in the background (MPI needs MPI_THREAD_MULTIPLE; NCCL's "
          "collectives on another thread can deadlock with the trainer's: give the Saver an MPI or thread group)");
  auto job = std::make_shared<AsyncJob>();
  try {
    impl_->prepare(state, *job);
  } catch (const std::exception&) {
    // This rank's error in the save's planning phase, so that every rank learns it.
    job->error = std::current_exception();
    job->shards.reset();
    job->unstaged = 0;
  }
  auto outcome = std::make_shared<AsyncSave::State>();
  if (job->unstaged == 0) outcome->mark_staged();
  auto run = [impl = impl_.get(), job, outcome, path] { impl->run(*job, *outcome, path); };
  try {
    impl_->background = std::thread(run);
  } catch (const std::system_error&) {
    run();  // no thread to spare: the save still happens, in the caller's time
  }
  return AsyncSave(outcome);
}

std::size_t Saver::async_host_bytes() const { return impl_->budget; }

std::size_t Saver::staging_bytes() const { return impl_->memory ? impl_->memory.bytes() : 0; }

}  // namespace shardckpt
