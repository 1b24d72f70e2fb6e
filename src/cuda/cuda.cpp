module;
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
module shardckpt.cuda;

namespace shardckpt {
namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw Error(Errc::device, cat("CUDA ", what, " failed: ", cudaGetErrorString(rc)));
}

}  // namespace

// Fences are numbered; each is an event recorded on the stream, kept until it is waited for.
struct CudaEngine::Impl {
  struct Recorded {
    Fence fence;
    cudaEvent_t event;
    std::uint64_t issued;  // operations issued before it
  };
  int device = 0;
  cudaStream_t stream = nullptr;
  std::mutex mutex;
  std::deque<Recorded> events;  // recorded, not yet waited for, in order
  Fence recorded = 0, reached = 0;
  std::atomic<std::uint64_t> issued{0}, landed{0};  // copies and zero fills: issued, seen finished
  std::atomic<std::uint64_t> device_allocations{0}, device_bytes{0}, pinned_allocations{0}, pinned_bytes{0},
      copies_to_host{0}, bytes_to_host{0}, copies_to_device{0}, bytes_to_device{0}, zero_fills{0};

  void use() const { check(cudaSetDevice(device), "cudaSetDevice"); }
};

int CudaEngine::devices() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

CudaEngine::CudaEngine(int device) : impl_(std::make_unique<Impl>()) {
  require(device >= 0 && device < devices(), Errc::device, "CUDA device ", device, " is not available (", devices(),
          " devices)");
  impl_->device = device;
  impl_->use();
  check(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
}

CudaEngine::~CudaEngine() {
  cudaSetDevice(impl_->device);
  cudaStreamSynchronize(impl_->stream);
  for (const Impl::Recorded& r : impl_->events) cudaEventDestroy(r.event);
  cudaStreamDestroy(impl_->stream);
}

MemorySpace CudaEngine::device() const noexcept { return MemorySpace::on_device(impl_->device); }

namespace {

// Memory of the CUDA runtime: pinned host memory (cudaFreeHost) or device memory (cudaFree on its
// device), freed when the last SharedBuffer of it goes.
class CudaAllocation final : public Allocation {
 public:
  CudaAllocation(void* p, std::size_t bytes, MemorySpace space) : Allocation(p, bytes, space) {}
  ~CudaAllocation() override {
    if (space().kind == MemoryKind::device) {
      cudaSetDevice(space().device);
      cudaFree(data());
    } else {
      cudaFreeHost(data());
    }
  }
};

}  // namespace

SharedBuffer CudaEngine::allocate_pinned(DType dtype, Extents shape) {
  impl_->use();
  const std::size_t bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  void* p = nullptr;
  check(cudaHostAlloc(&p, std::max<std::size_t>(bytes, 1), cudaHostAllocPortable), "cudaHostAlloc");
  ++impl_->pinned_allocations;
  impl_->pinned_bytes += bytes;
  count_allocation(bytes);
  return SharedBuffer(std::make_shared<CudaAllocation>(p, std::max<std::size_t>(bytes, 1), MemorySpace::pinned()), dtype,
                      shape);
}

SharedBuffer CudaEngine::allocate_device(DType dtype, Extents shape) {
  impl_->use();
  const std::size_t bytes = static_cast<std::size_t>(shape.elements()) * dtype_size(dtype);
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), "cudaMalloc");
  ++impl_->device_allocations;
  impl_->device_bytes += bytes;
  count_allocation(bytes);
  return SharedBuffer(std::make_shared<CudaAllocation>(p, std::max<std::size_t>(bytes, 1), device()), dtype, shape);
}

void CudaEngine::copy_to_host(TensorView device_src, MutTensorView host_dst) {
  check_copy("a copy to the host", device_src, host_dst);
  if (device_src.empty()) return;
  impl_->use();
  check(cudaMemcpyAsync(host_dst.data(), device_src.data(), device_src.bytes(), cudaMemcpyDeviceToHost, impl_->stream),
        "cudaMemcpyAsync (device to host)");
  ++impl_->issued;
  ++impl_->copies_to_host;
  impl_->bytes_to_host += device_src.bytes();
}

void CudaEngine::copy_to_device(TensorView host_src, MutTensorView device_dst) {
  check_copy("a copy to the device", device_dst, host_src);
  if (host_src.empty()) return;
  impl_->use();
  check(cudaMemcpyAsync(device_dst.data(), host_src.data(), host_src.bytes(), cudaMemcpyHostToDevice, impl_->stream),
        "cudaMemcpyAsync (host to device)");
  ++impl_->issued;
  ++impl_->copies_to_device;
  impl_->bytes_to_device += host_src.bytes();
}

void CudaEngine::zero(MutTensorView device_dst) {
  check_zero(device_dst);
  if (device_dst.empty()) return;
  impl_->use();
  check(cudaMemsetAsync(device_dst.data(), 0, device_dst.bytes(), impl_->stream), "cudaMemsetAsync");
  ++impl_->issued;
  ++impl_->zero_fills;
}

Fence CudaEngine::fence() {
  impl_->use();
  cudaEvent_t event = nullptr;
  // Blocking: a waiting rank thread sleeps instead of spinning beside the threads writing files.
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync), "cudaEventCreate");
  // Recorded under the lock, so that fence numbers follow the events' order on the stream.
  const std::lock_guard lock(impl_->mutex);
  if (const cudaError_t rc = cudaEventRecord(event, impl_->stream); rc != cudaSuccess) {
    cudaEventDestroy(event);
    check(rc, "cudaEventRecord");
  }
  impl_->events.push_back({++impl_->recorded, event, impl_->issued});
  return impl_->recorded;
}

void CudaEngine::wait(Fence fence) {
  impl_->use();
  const std::lock_guard lock(impl_->mutex);
  // Events complete in stream order: waiting for the fence retires every earlier one too.
  while (impl_->reached < fence && !impl_->events.empty()) {
    const Impl::Recorded r = impl_->events.front();
    const cudaError_t rc = cudaEventSynchronize(r.event);
    cudaEventDestroy(r.event);
    impl_->events.pop_front();
    impl_->reached = r.fence;
    check(rc, "cudaEventSynchronize (an earlier copy failed)");
    impl_->landed = r.issued;
  }
}

void CudaEngine::follow(cudaStream_t stream) {
  impl_->use();
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  const cudaError_t recorded = cudaEventRecord(event, stream);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(impl_->stream, event, 0) : recorded;
  cudaEventDestroy(event);  // the wait keeps what it needs of the event
  check(recorded, "cudaEventRecord (on the trainer's stream)");
  check(waited, "cudaStreamWaitEvent");
}

EngineStats CudaEngine::stats() const {
  const Impl& m = *impl_;
  return {m.device_allocations, m.device_bytes,     m.pinned_allocations, m.pinned_bytes, m.copies_to_host,
          m.bytes_to_host,      m.copies_to_device, m.bytes_to_device,    m.zero_fills,   m.issued - m.landed};
}

std::size_t CudaEngine::free_device_memory() const {
  impl_->use();
  std::size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

// The library's device maker in a build with CUDA (src/engine.cpp names it, so that a static link
// keeps this unit): CUDA devices are the library's devices.
extern "C++" std::shared_ptr<CopyEngine> shardckpt_make_cuda_engine(int device) {
  return std::make_shared<CudaEngine>(device);
}

}  // namespace shardckpt
