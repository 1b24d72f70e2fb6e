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
namespace {
namespace fs = std::filesystem;
}  // namespace

// ---- async saves -------------------------------------------------------------------------------

struct AsyncSave::State {
  std::mutex mutex;
  std::condition_variable changed;
  bool finished = false;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    const std::lock_guard lock(mutex);
    error = std::move(e);
    finished = true;
    changed.notify_all();
  }
};

AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;
AsyncSave& AsyncSave::operator=(AsyncSave&&) noexcept = default;
AsyncSave::~AsyncSave() = default;

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

struct Saver::Impl {
  SaverOptions options;
  std::shared_ptr<StagingPool> pool;
  std::unique_ptr<ProcessGroup> group;  // private: background saves never meet the caller's collectives
  SharedBuffer staging;                 // where async saves stage this rank's bytes; sized once
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

  // Pinned memory of the engine's (locked host memory without an engine) for async saves.
  SharedBuffer allocate_staging(std::size_t bytes) const {
    const Extents shape{static_cast<std::int64_t>(bytes)};
    return options.engine ? options.engine->allocate_pinned(DType::u8, shape) : allocate_locked(DType::u8, shape);
  }

  // Copies every byte this rank writes into the staging memory (allocated by the first call) and
  // returns the plan of those copies.
  SavePlan stage(const StateDict& state) {
    constexpr std::size_t align = 64;
    SavePlan plan = prepare_save(state);
    std::size_t need = 0;
    for (const SaveItem& i : plan.items)
      if (i.writes) need = (need + align - 1) / align * align + i.data.bytes();
    if (!staging)
      staging = allocate_staging(std::max(need, options.async_staging_bytes));
    require(need <= staging.bytes(), Errc::invalid_argument, "an async save of ", need,
            " bytes does not fit the staging memory of ", staging.bytes(),
            " bytes sized by the first (set SaverOptions::async_staging_bytes, or make a new Saver)");
    std::byte* base = staging.mut_view().data();
    std::size_t at = 0;
    for (SaveItem& i : plan.items) {
      if (!i.writes) {
        i.data = {};  // never read: another rank writes these rows
        continue;
      }
      at = (at + align - 1) / align * align;
      const MutTensorView to = MutTensorView::unchecked(base + at, i.data.dtype(), i.data.shape(), MemorySpace::pinned());
      at += i.data.bytes();
      if (i.data.space().host_accessible()) {
        if (!i.data.empty()) std::memcpy(to.data(), i.data.data(), i.data.bytes());
      } else {
        require(options.engine != nullptr && options.engine->device() == i.data.space(), Errc::invalid_argument, "key ",
                i.key, ": an async save of ", memory_space_text(i.data.space()),
                " memory needs a Saver with that device's CopyEngine");
        options.engine->copy_to_host(i.data, to);
      }
      i.data = to;
    }
    if (options.engine) options.engine->wait(options.engine->fence());
    return plan;
  }
};

Saver::Saver(ProcessGroup& group, SaverOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->group = group.split(0, group.rank());
  agree(*impl_->group, "making a saver", [&] {
    if (impl_->options.engine)
      impl_->pool = std::make_shared<StagingPool>(impl_->options.engine, impl_->options.staging_buffer_bytes,
                                                  impl_->options.staging_buffers);
  });
}

Saver::~Saver() { impl_->join(); }

void Saver::save(const StateDict& state, const fs::path& path) {
  impl_->join();
  shardckpt::save(state, path, *impl_->group, impl_->save_options());
}

AsyncSave Saver::save_async(const StateDict& state, const fs::path& path) {
  impl_->join();
  require(impl_->group->supports_background(), Errc::invalid_argument,
          "this process group cannot run a save in the background (MPI needs MPI_THREAD_MULTIPLE; NCCL's "
          "collectives on another thread can deadlock with the trainer's: give the Saver an MPI or thread group)");
  // A failure to stage is this rank's error in the save's planning phase, so that every rank learns it.
  std::exception_ptr staging_error;
  auto plan = std::make_shared<SavePlan>();
  try {
    *plan = impl_->stage(state);
  } catch (const std::exception&) {
    staging_error = std::current_exception();
  }
  auto outcome = std::make_shared<AsyncSave::State>();
  auto run = [impl = impl_.get(), plan, staging_error, path, outcome] {
    try {
      save_with(
          [&] {
            if (staging_error) std::rethrow_exception(staging_error);
            return std::move(*plan);
          },
          path, *impl->group, impl->save_options());
      outcome->finish(nullptr);
    } catch (...) {
      outcome->finish(std::current_exception());
    }
  };
  try {
    impl_->background = std::thread(run);
  } catch (const std::system_error&) {
    run();  // no thread to spare: the save still happens, in the caller's time
  }
  return AsyncSave(outcome);
}

std::size_t Saver::staging_bytes() const {
  return (impl_->pool ? impl_->pool->bytes() : 0) + impl_->staging.bytes();
}

}  // namespace shardckpt
