module;
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>
module shardckpt.engine;

namespace shardckpt {
namespace {

std::size_t page_size() {
  static const auto size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t round_to_pages(std::size_t bytes) {
  const std::size_t p = page_size();
  return std::max<std::size_t>(p, (bytes + p - 1) / p * p);
}

void* map_pages(std::size_t bytes, int protection) {
  void* p = ::mmap(nullptr, bytes, protection, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw Error(Errc::internal, cat("could not map ", bytes, " bytes of memory"));
  return p;
}

// Every page of [p, p + size) backed by memory now, so that no later write to it waits for the kernel
// to find and zero a page: the budget of a Saver is touched once, when it is made, never by a save.
// Transparent huge pages where the kernel has them (512 times fewer faults and TLB entries), asked
// before the pages exist; MADV_POPULATE_WRITE (Linux 5.14) faults them in with one call and says
// ENOMEM when the memory is not there (a store to each page would meet the OOM killer instead);
// older kernels get one store per page.
void populate(void* p, std::size_t size) {
#ifdef MADV_HUGEPAGE
  if (size >= (std::size_t{2} << 20)) (void)::madvise(p, size, MADV_HUGEPAGE);
#endif
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;
#endif
  if (::madvise(p, size, MADV_POPULATE_WRITE) == 0) return;
  const int err = errno;
  if (err == ENOMEM || err == EFAULT || err == EHWPOISON) {
    ::munmap(p, size);
    throw Error(Errc::resources, cat("could not back ", size, " bytes of host memory with pages: ", std::strerror(err)));
  }
  auto* bytes = static_cast<volatile unsigned char*>(p);
  for (std::size_t at = 0; at < size; at += page_size()) bytes[at] = 0;
}

}  // namespace

void CopyEngine::check_copy(std::string_view what, TensorView device, TensorView host) const {
  require(device.bytes() == host.bytes(), Errc::invalid_argument, what, " on ", name(), " ", memory_space_text(this->device()),
          ": ", device.bytes(), " bytes of device memory, ", host.bytes(), " bytes of host memory");
  require(device.space() == this->device() && host.space().host_accessible(), Errc::invalid_argument, what, " on ",
          name(), " ", memory_space_text(this->device()), " between ", memory_space_text(device.space()), " and ",
          memory_space_text(host.space()), " memory");
}

void CopyEngine::check_zero(TensorView device) const {
  require(device.space() == this->device(), Errc::invalid_argument, "zeroing ", memory_space_text(device.space()),
          " memory on ", name(), " ", memory_space_text(this->device()));
}

namespace {

// Pages mapped for the library (locked host memory, emulated device memory), unmapped when the last
// SharedBuffer of them goes; `on_free` runs then too.
class MappedPages final : public Allocation {
 public:
  MappedPages(void* p, std::size_t size, MemorySpace space, bool locked, std::function<void()> on_free = {})
      : Allocation(p, size, space), locked_(locked), on_free_(std::move(on_free)) {}
  ~MappedPages() override {
    if (locked_) ::munlock(data(), bytes());
    ::munmap(data(), bytes());
    if (on_free_) on_free_();
  }

 private:
  bool locked_;
  std::function<void()> on_free_;
};

}  // namespace

SharedBuffer allocate_locked(DType dtype, Extents shape) {
  const std::size_t bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  const std::size_t size = round_to_pages(bytes);
  void* p = map_pages(size, PROT_READ | PROT_WRITE);
  populate(p, size);
  // Best effort: without the privilege or the limit to lock it, the memory stays pageable (but
  // backed: populate faulted every page in).
  (void)::mlock(p, size);
  count_allocation(size);
  return SharedBuffer(std::make_shared<MappedPages>(p, size, MemorySpace::pinned(), true), dtype, shape);
}

// The emulated stream: one thread runs the copies in order; fences count the work enqueued.
struct EmulatedDevice::Impl {
  int id = 0;
  Progress progress = Progress::eager;
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::function<void()>> queue;
  Fence enqueued = 0, done = 0, released = 0;  // released: the latest fence waited for
  bool stopping = false;
  std::optional<Error> failure;
  std::thread worker;
  std::atomic<std::uint64_t> device_allocations{0}, device_bytes{0}, pinned_allocations{0}, pinned_bytes{0},
      copies_to_host{0}, bytes_to_host{0}, copies_to_device{0}, bytes_to_device{0}, zero_fills{0};
  // Shared with every allocation, which gives its pages back to this count when freed: an allocation
  // may outlive the engine that made it.
  std::shared_ptr<std::atomic<std::uint64_t>> live_device_bytes = std::make_shared<std::atomic<std::uint64_t>>(0);

  void run() {
    std::unique_lock lock(mutex);
    for (;;) {
      changed.wait(lock, [&] {
        return stopping || (!queue.empty() && (progress == Progress::eager || done < released));
      });
      if (queue.empty()) return;
      std::function<void()> task = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      std::optional<Error> error;
      try {
        task();
      } catch (const Error& e) {
        error = e;
      }
      lock.lock();
      if (error && !failure) failure = std::move(error);
      ++done;
      changed.notify_all();
    }
  }

  void enqueue(std::function<void()> task) {
    const std::lock_guard lock(mutex);
    queue.push_back(std::move(task));
    ++enqueued;
    changed.notify_all();
  }

  // Runs fn with the device pages under [p, p + n) opened with `protection`, then closes them again.
  static void with_pages(const void* p, std::size_t n, int protection, const std::function<void()>& fn) {
    if (n == 0) return;
    const auto begin = reinterpret_cast<std::uintptr_t>(p) / page_size() * page_size();
    const auto end = round_to_pages(reinterpret_cast<std::uintptr_t>(p) + n);
    void* pages = reinterpret_cast<void*>(begin);
    if (::mprotect(pages, end - begin, protection) != 0)
      throw Error(Errc::internal, "the emulated device could not open its memory for a copy");
    fn();
    ::mprotect(pages, end - begin, PROT_NONE);
  }
};

EmulatedDevice::EmulatedDevice(int id, Progress progress) : impl_(std::make_unique<Impl>()) {
  impl_->id = id;
  impl_->progress = progress;
  impl_->worker = std::thread([this] { impl_->run(); });
}

EmulatedDevice::~EmulatedDevice() {
  {
    const std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
    impl_->changed.notify_all();
  }
  impl_->worker.join();
}

MemorySpace EmulatedDevice::device() const noexcept { return MemorySpace::on_device(impl_->id); }

SharedBuffer EmulatedDevice::allocate_pinned(DType dtype, Extents shape) {
  ++impl_->pinned_allocations;
  impl_->pinned_bytes += static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  return allocate_locked(dtype, shape);
}

SharedBuffer EmulatedDevice::allocate_device(DType dtype, Extents shape) {
  const std::size_t bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  const std::size_t size = round_to_pages(bytes);
  void* p = map_pages(size, PROT_NONE);
  ++impl_->device_allocations;
  impl_->device_bytes += bytes;
  *impl_->live_device_bytes += size;
  count_allocation(bytes);
  return SharedBuffer(std::make_shared<MappedPages>(p, size, device(), false,
                                                    [size, live = impl_->live_device_bytes] { *live -= size; }),
                      dtype, shape);
}

void EmulatedDevice::copy_to_host(TensorView device_src, MutTensorView host_dst) {
  check_copy("a copy to the host", device_src, host_dst);
  ++impl_->copies_to_host;
  impl_->bytes_to_host += device_src.bytes();
  impl_->enqueue([src = device_src.data(), dst = host_dst.data(), n = device_src.bytes()] {
    Impl::with_pages(src, n, PROT_READ, [&] { std::memcpy(dst, src, n); });
  });
}

void EmulatedDevice::copy_to_device(TensorView host_src, MutTensorView device_dst) {
  check_copy("a copy to the device", device_dst, host_src);
  ++impl_->copies_to_device;
  impl_->bytes_to_device += host_src.bytes();
  impl_->enqueue([src = host_src.data(), dst = device_dst.data(), n = host_src.bytes()] {
    Impl::with_pages(dst, n, PROT_READ | PROT_WRITE, [&] { std::memcpy(dst, src, n); });
  });
}

void EmulatedDevice::zero(MutTensorView device_dst) {
  check_zero(device_dst);
  ++impl_->zero_fills;
  impl_->enqueue([dst = device_dst.data(), n = device_dst.bytes()] {
    Impl::with_pages(dst, n, PROT_READ | PROT_WRITE, [&] { std::memset(dst, 0, n); });
  });
}

Fence EmulatedDevice::fence() {
  const std::lock_guard lock(impl_->mutex);
  return impl_->enqueued;
}

void EmulatedDevice::wait(Fence fence) {
  std::unique_lock lock(impl_->mutex);
  impl_->released = std::max(impl_->released, fence);
  impl_->changed.notify_all();
  impl_->changed.wait(lock, [&] { return impl_->done >= fence; });
  if (impl_->failure) throw std::exchange(impl_->failure, std::nullopt).value();
}

EngineStats EmulatedDevice::stats() const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  return {m.device_allocations, m.device_bytes,     m.pinned_allocations, m.pinned_bytes, m.copies_to_host,
          m.bytes_to_host,      m.copies_to_device, m.bytes_to_device,    m.zero_fills,   m.enqueued - m.done};
}

// An emulated device of 64 GiB.
std::size_t EmulatedDevice::free_device_memory() const {
  return (std::size_t{64} << 30) - static_cast<std::size_t>(impl_->live_device_bytes->load());
}

StagingPool::StagingPool(std::shared_ptr<CopyEngine> engine, std::size_t buffer_bytes, int buffers)
    : engine_(std::move(engine)), buffer_bytes_(buffer_bytes) {
  require(engine_ != nullptr, Errc::invalid_argument, "a staging pool needs a copy engine");
  require(buffer_bytes > 0 && buffers >= 1, Errc::invalid_argument, "a staging pool needs at least one buffer of ",
          "at least one byte (got ", buffers, " of ", buffer_bytes, ")");
  for (int i = 0; i < buffers; ++i) {
    memory_.push_back(engine_->allocate_pinned(DType::u8, {static_cast<std::int64_t>(buffer_bytes)}));
    buffers_.push_back(memory_.back().mut_view());
  }
}

StagingPool::StagingPool(std::shared_ptr<CopyEngine> engine, SharedBuffer memory, std::size_t buffer_bytes)
    : engine_(std::move(engine)), buffer_bytes_(buffer_bytes) {
  require(engine_ != nullptr, Errc::invalid_argument, "a staging pool needs a copy engine");
  require(memory.space().host_accessible() && buffer_bytes > 0 && memory.bytes() >= buffer_bytes,
          Errc::invalid_argument, "a staging pool over ", memory.bytes(), " bytes of ",
          memory_space_text(memory.space()), " memory cannot hold a buffer of ", buffer_bytes, " bytes");
  std::byte* base = memory.mut_view().data();
  for (std::size_t at = 0; at + buffer_bytes <= memory.bytes(); at += buffer_bytes)
    buffers_.push_back(MutTensorView::unchecked(base + at, DType::u8, {static_cast<std::int64_t>(buffer_bytes)},
                                                MemorySpace::pinned()));
  memory_.push_back(std::move(memory));
}

std::int64_t StagingPool::rows_per_buffer(TensorView like) const {
  const std::size_t row = std::max<std::size_t>(like.row_bytes(), 1);
  require(row <= buffer_bytes_, Errc::invalid_argument, "a row of ", row, " bytes does not fit a staging buffer of ",
          buffer_bytes_, " bytes: make the buffers larger");
  return static_cast<std::int64_t>(buffer_bytes_ / row);
}

MutTensorView StagingPool::buffer(int i) {
  require(i >= 0 && i < buffers(), Errc::invalid_argument, "staging buffer ", i, " of ", buffers());
  return buffers_[static_cast<std::size_t>(i)];
}

MutTensorView StagingPool::rows_of(int i, TensorView like, std::int64_t rows) {
  require(i >= 0 && i < buffers() && rows >= 0 && rows <= rows_per_buffer(like), Errc::invalid_argument, rows,
          " rows do not fit staging buffer ", i);
  return MutTensorView::unchecked(buffers_[static_cast<std::size_t>(i)].data(), like.dtype(),
                               like.shape().with_rows(rows), MemorySpace::pinned());
}

#if SHARDCKPT_HAVE_CUDA
// In src/cuda/cuda.cpp: a CudaEngine of the device.
extern "C++" std::shared_ptr<CopyEngine> shardckpt_make_cuda_engine(int device);
#endif

namespace {

DeviceEngineMaker library_device_maker() {
#if SHARDCKPT_HAVE_CUDA
  return [](int device) { return shardckpt_make_cuda_engine(device); };
#else
  return nullptr;
#endif
}

// What the library made for devices: the maker (CUDA's where the library has it), and per device its
// engine and the pools handed out.
struct DeviceEngines {
  std::mutex mutex;
  DeviceEngineMaker maker = library_device_maker();
  std::map<int, std::shared_ptr<CopyEngine>> engines;
  std::map<int, std::vector<std::shared_ptr<StagingPool>>> pools;
};

DeviceEngines& device_engines() {
  static DeviceEngines* const registry = new DeviceEngines;  // never destroyed: engines may outlive main's statics
  return *registry;
}

std::shared_ptr<CopyEngine> engine_locked(DeviceEngines& d, MemorySpace space) {
  require(space.kind == MemoryKind::device, Errc::invalid_argument, "no device engine for ",
          memory_space_text(space), " memory");
  std::shared_ptr<CopyEngine>& engine = d.engines[space.device];
  if (!engine) {
    require(static_cast<bool>(d.maker), Errc::device, memory_space_text(space),
            " memory: this shardckpt has no engine for devices (built without CUDA): give the save or load a "
            "StagingPool of a CopyEngine of yours");
    engine = d.maker(space.device);
    require(engine != nullptr && engine->device() == space, Errc::device, "the device maker made no engine for ",
            memory_space_text(space));
  }
  return engine;
}

}  // namespace

DeviceEngineMaker set_device_engine_maker(DeviceEngineMaker maker) {
  DeviceEngines& d = device_engines();
  const std::lock_guard lock(d.mutex);
  d.engines.clear();
  d.pools.clear();
  return std::exchange(d.maker, std::move(maker));
}

std::shared_ptr<CopyEngine> device_engine(MemorySpace space) {
  DeviceEngines& d = device_engines();
  const std::lock_guard lock(d.mutex);
  return engine_locked(d, space);
}

std::shared_ptr<StagingPool> device_staging(MemorySpace space) {
  DeviceEngines& d = device_engines();
  const std::lock_guard lock(d.mutex);
  std::shared_ptr<CopyEngine> engine = engine_locked(d, space);
  std::vector<std::shared_ptr<StagingPool>>& pools = d.pools[space.device];
  // Copies of a handed-out pool are made only here, under the lock: one held by the registry alone is free.
  for (const std::shared_ptr<StagingPool>& pool : pools)
    if (pool.use_count() == 1) {
      // The last holder's use of the buffers happened before its release of the pool.
      std::atomic_thread_fence(std::memory_order_acquire);
      return pool;
    }
  pools.push_back(std::make_shared<StagingPool>(std::move(engine)));
  return pools.back();
}

}  // namespace shardckpt
