// shardckpt.cuda: the CopyEngine of one CUDA device (built when the CUDA toolkit is found). The
// CUDA runtime only, no kernels: cudaMemcpyAsync and cudaMemsetAsync on the engine's own stream,
// events as fences, pinned memory from cudaHostAlloc, and device memory from cudaMalloc for tests
// and tools (a trainer borrows its own). Every CUDA error is Errc::device naming the call. The CUDA
// runtime keeps a current device per host thread: every call of the engine makes its device the
// calling thread's current one (and leaves it so).
module;
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string_view>
export module shardckpt.cuda;
import shardckpt.core;
import shardckpt.views;
import shardckpt.engine;

export namespace shardckpt {

class CudaEngine final : public CopyEngine {
 public:
  // CUDA devices this process can use; 0 without a driver or a device.
  static int devices() noexcept;
  // Throws Errc::device when the device cannot be used (none, say).
  explicit CudaEngine(int device = 0);
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;
  ~CudaEngine() override;

  std::string_view name() const noexcept override { return "cuda"; }
  MemorySpace device() const noexcept override;
  SharedBuffer allocate_pinned(DType dtype, Extents shape) override;
  SharedBuffer allocate_device(DType dtype, Extents shape) override;
  void copy_to_host(TensorView device_src, MutTensorView host_dst) override;
  void copy_to_device(TensorView host_src, MutTensorView device_dst) override;
  void zero(MutTensorView device_dst) override;
  Fence fence() override;
  void wait(Fence fence) override;
  // The engine's later work waits, on the device, for the work enqueued on `stream` so far: call it
  // after the kernels that write the weights and before saving them (the engine's stream does not
  // otherwise wait for the trainer's), instead of synchronizing the device.
  void follow(cudaStream_t stream);
  EngineStats stats() const override;
  // cudaMemGetInfo's free bytes.
  std::size_t free_device_memory() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardckpt
