// shardckpt.engine: how bytes move between a device and the host. A CopyEngine is the only way
// device bytes reach the host or host bytes a device: it copies asynchronously on its own stream, in
// order, and fences order its work with the caller's. The CUDA engine (shardckpt.cuda, built when the
// CUDA toolkit is found) sits on top of this interface; EmulatedDevice, here, is a device whose memory
// the host cannot touch (any access outside the engine's copies crashes), for tests and for machines
// without a GPU. A StagingPool is a fixed set of pinned buffers through which device rows go to and
// from files. This module does no file I/O.
module;
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>
export module shardckpt.engine;
import shardckpt.core;
import shardckpt.views;

export namespace shardckpt {

// A point in an engine's stream: waiting for it waits for all work enqueued before it.
using Fence = std::uint64_t;

// What an engine did since it was made, for tests and reports.
struct EngineStats {
  std::uint64_t device_allocations = 0, device_bytes = 0;
  std::uint64_t pinned_allocations = 0, pinned_bytes = 0;
  std::uint64_t copies_to_host = 0, bytes_to_host = 0;
  std::uint64_t copies_to_device = 0, bytes_to_device = 0;
  std::uint64_t zero_fills = 0;
  // Copies and zero fills issued that no wait has seen finish yet: 0 after any call of the library
  // that promises its device work has landed.
  std::uint64_t unfinished = 0;
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::string_view name() const noexcept = 0;
  // The device whose memory this engine moves.
  virtual MemorySpace device() const noexcept = 0;
  // Host memory the engine copies at full speed (pinned), as a tensor of `dtype` and `shape` (a
  // byte buffer: u8). Allocate once, reuse.
  virtual SharedBuffer allocate_pinned(DType dtype, Extents shape) = 0;
  // Device memory, for tests and tools: a trainer brings its own and borrows it.
  virtual SharedBuffer allocate_device(DType dtype, Extents shape) = 0;
  // Asynchronous, in order on the engine's stream. The views must have the same bytes; `host`
  // must stay alive and untouched until a later fence is waited for.
  virtual void copy_to_host(TensorView device_src, MutTensorView host_dst) = 0;
  virtual void copy_to_device(TensorView host_src, MutTensorView device_dst) = 0;
  virtual void zero(MutTensorView device_dst) = 0;
  virtual Fence fence() = 0;
  virtual void wait(Fence fence) = 0;
  virtual EngineStats stats() const = 0;
  // Free memory on the device as the device reports it (0 where it cannot tell).
  virtual std::size_t free_device_memory() const { return 0; }

 protected:
  // Throws Errc::invalid_argument unless `device` is this engine's memory, `host` is host memory and
  // both have the same bytes; `what` names the copy.
  void check_copy(std::string_view what, TensorView device, TensorView host) const;
  // The same for a zero fill of `device`.
  void check_zero(TensorView device) const;
};

// Page-aligned host memory locked with mlock where the system allows (what pinned means without
// a CUDA driver), in the pinned memory space; every page faulted in before it returns (huge pages
// where the kernel has them), so that no copy into it later waits for the kernel: Errc::resources
// when the memory is not there.
SharedBuffer allocate_locked(DType dtype, Extents shape);

// An emulated device: its memory is mapped PROT_NONE except while the engine's own thread copies or
// zeroes it, so that any host access to device memory outside the engine crashes the process.
class EmulatedDevice final : public CopyEngine {
 public:
  // When its stream runs the work enqueued: eagerly, or only once a fence after it is waited for
  // (like a device that is slow to start), so that a caller that forgets to wait sees it undone.
  enum class Progress { eager, when_waited };
  explicit EmulatedDevice(int id = 0, Progress progress = Progress::eager);
  EmulatedDevice(const EmulatedDevice&) = delete;
  EmulatedDevice& operator=(const EmulatedDevice&) = delete;
  ~EmulatedDevice() override;

  std::string_view name() const noexcept override { return "emulated"; }
  MemorySpace device() const noexcept override;
  SharedBuffer allocate_pinned(DType dtype, Extents shape) override;
  SharedBuffer allocate_device(DType dtype, Extents shape) override;
  void copy_to_host(TensorView device_src, MutTensorView host_dst) override;
  void copy_to_device(TensorView host_src, MutTensorView device_dst) override;
  void zero(MutTensorView device_dst) override;
  Fence fence() override;
  void wait(Fence fence) override;
  EngineStats stats() const override;
  std::size_t free_device_memory() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A fixed number of pinned buffers of a fixed size, allocated once (when the pool is made, or cut from
// memory given to it) and reused for every transfer: what staging device rows through the host
// costs, whatever the model's size.
class StagingPool {
 public:
  // Default: two buffers of 64 MiB, so that copying one overlaps with writing (or reading) the other.
  static constexpr std::size_t default_buffer_bytes = std::size_t{64} << 20;
  // The pool shares the ownership of its engine: the engine lives while the pool does.
  explicit StagingPool(std::shared_ptr<CopyEngine> engine, std::size_t buffer_bytes = default_buffer_bytes,
                       int buffers = 2);
  // The buffers cut from `memory` (pinned memory of the engine's), as many of `buffer_bytes` as fit
  // (at least one): one allocation that its owner also uses whole, when nothing streams through the
  // pool (a Saver's budget for async saves).
  StagingPool(std::shared_ptr<CopyEngine> engine, SharedBuffer memory, std::size_t buffer_bytes);
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  CopyEngine& engine() const noexcept [[clang::lifetimebound]] { return *engine_; }
  int buffers() const noexcept { return static_cast<int>(buffers_.size()); }
  std::size_t buffer_bytes() const noexcept { return buffer_bytes_; }
  std::size_t bytes() const noexcept { return buffer_bytes_ * buffers_.size(); }
  // Buffer `i` seen as `rows` rows shaped like `like` (its dtype and trailing dims), in pinned memory.
  // Throws Errc::invalid_argument when they do not fit.
  MutTensorView rows_of(int i, TensorView like, std::int64_t rows) [[clang::lifetimebound]];
  // How many rows of `like` one buffer holds (at least one, or Errc::invalid_argument).
  std::int64_t rows_per_buffer(TensorView like) const;
  // Buffer `i`'s bytes, in pinned memory: from a pool its user may write to, not a const one.
  MutTensorView buffer(int i) [[clang::lifetimebound]];

 private:
  std::shared_ptr<CopyEngine> engine_;
  std::size_t buffer_bytes_;
  std::vector<SharedBuffer> memory_;   // the allocations the buffers lie in
  std::vector<MutTensorView> buffers_;
};

// The engine and pools the library uses for a device's memory when its caller gives none (a save or
// load of device shards without SaveOptions::staging or LoadOptions::staging, Python's tensors on a
// GPU). One engine per device for the process, made on first use by the device maker: CudaEngine,
// where the library is built with CUDA; none otherwise (Errc::device).
using DeviceEngineMaker = std::function<std::shared_ptr<CopyEngine>(int device)>;
// Puts `maker` in place of the device maker (an engine for other hardware, an emulated device for
// tests), forgets the engines and pools made by the one before, and returns that one. Engines and
// pools already handed out stay alive with their holders.
DeviceEngineMaker set_device_engine_maker(DeviceEngineMaker maker);
// The process's engine for `space` (device memory): made by the device maker the first time.
// Throws Errc::invalid_argument for host memory, Errc::device when no maker is registered or it
// cannot make one (no such device).
std::shared_ptr<CopyEngine> device_engine(MemorySpace space);
// A pool of pinned buffers (the default two of 64 MiB) of `space`'s engine that no one else is using:
// a pool handed out before and since let go is handed out again, else a new one is made (and kept
// for the life of the process). A load or a save holds it for as long as it runs, so ranks that run
// at once never share buffers.
std::shared_ptr<StagingPool> device_staging(MemorySpace space);

}  // namespace shardckpt
