module;
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>
module shardckpt.dist.nccl;

namespace shardckpt {
namespace {

void check_cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw Error(Errc::collective, cat("CUDA ", what, " failed: ", cudaGetErrorString(rc)));
}

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess) throw Error(Errc::collective, cat("NCCL ", what, " failed: ", ncclGetErrorString(rc)));
}

// Device memory with an owner.
struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(std::size_t n) { check_cuda(cudaMalloc(&ptr, std::max<std::size_t>(n, 1)), "cudaMalloc"); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes() { cudaFree(ptr); }
};

}  // namespace

struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;

  void sync() { check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); }
};

int NcclGroup::devices() noexcept { return CudaEngine::devices(); }

NcclGroup::NcclGroup(ProcessGroup& bootstrap, int device) : impl_(std::make_unique<Impl>()) {
  rank_ = bootstrap.rank();
  size_ = bootstrap.size();
  ncclUniqueId id{};
  if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  const auto shared = bootstrap.broadcast(std::as_bytes(std::span(&id, 1)), 0);
  std::memcpy(&id, shared.data(), sizeof id);
  impl_->device = device;
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  check_cuda(cudaStreamCreate(&impl_->stream), "cudaStreamCreate");
  check_nccl(ncclCommInitRank(&impl_->comm, size_, id, rank_), "ncclCommInitRank");
}

std::unique_ptr<ProcessGroup> NcclGroup::split(int color, int key) {
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");
  std::unique_ptr<NcclGroup> part(new NcclGroup());
  part->impl_ = std::make_unique<Impl>();
  part->impl_->device = impl_->device;
  check_nccl(ncclCommSplit(impl_->comm, color, key, &part->impl_->comm, nullptr), "ncclCommSplit");
  check_cuda(cudaStreamCreate(&part->impl_->stream), "cudaStreamCreate");
  check_nccl(ncclCommUserRank(part->impl_->comm, &part->rank_), "ncclCommUserRank");
  check_nccl(ncclCommCount(part->impl_->comm, &part->size_), "ncclCommCount");
  return part;
}

bool NcclGroup::moves(MemorySpace space) const {
  return space == MemorySpace::on_device(impl_->device);
}

void NcclGroup::all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) {
  require_row_counts(rows, counts, size_);
  require(moves(rows.space()), Errc::invalid_argument, "an NCCL group on device ", impl_->device, " moves its memory, not ",
          memory_space_text(rows.space()), " memory");
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  std::int64_t start = 0;
  for (int r = 0; r < size_; ++r) {
    const std::int64_t n = counts[static_cast<std::size_t>(r)];
    std::byte* at = rows.data() + static_cast<std::size_t>(start) * rows.row_bytes();
    if (n > 0)
      check_nccl(ncclBroadcast(at, at, static_cast<std::size_t>(n) * rows.row_bytes(), ncclUint8, r, impl_->comm,
                               impl_->stream),
                 "ncclBroadcast");
    start += n;
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  impl_->sync();
}

NcclGroup::~NcclGroup() {
  if (impl_->comm) ncclCommDestroy(impl_->comm);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

void NcclGroup::barrier() {
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");
  DeviceBytes one(sizeof(std::int32_t));
  check_cuda(cudaMemsetAsync(one.ptr, 0, sizeof(std::int32_t), impl_->stream), "cudaMemsetAsync");
  check_nccl(ncclAllReduce(one.ptr, one.ptr, 1, ncclInt32, ncclSum, impl_->comm, impl_->stream), "ncclAllReduce");
  impl_->sync();
}

std::vector<std::vector<std::byte>> NcclGroup::all_gather(std::span<const std::byte> mine) {
  check_cuda(cudaSetDevice(impl_->device), "cudaSetDevice");
  // Sizes first, then every rank's bytes padded to the largest.
  const auto n = static_cast<std::int64_t>(mine.size());
  DeviceBytes sizes(sizeof(std::int64_t) * static_cast<std::size_t>(size_));
  auto* my_size = static_cast<std::int64_t*>(sizes.ptr) + rank_;
  check_cuda(cudaMemcpyAsync(my_size, &n, sizeof n, cudaMemcpyHostToDevice, impl_->stream), "cudaMemcpyAsync");
  check_nccl(ncclAllGather(my_size, sizes.ptr, 1, ncclInt64, impl_->comm, impl_->stream), "ncclAllGather");
  std::vector<std::int64_t> all_sizes(static_cast<std::size_t>(size_));
  check_cuda(cudaMemcpyAsync(all_sizes.data(), sizes.ptr, sizeof(std::int64_t) * all_sizes.size(),
                             cudaMemcpyDeviceToHost, impl_->stream),
             "cudaMemcpyAsync");
  impl_->sync();
  const auto widest = static_cast<std::size_t>(*std::max_element(all_sizes.begin(), all_sizes.end()));
  DeviceBytes data(widest * static_cast<std::size_t>(size_));
  auto* my_slot = static_cast<std::byte*>(data.ptr) + widest * static_cast<std::size_t>(rank_);
  if (n > 0)
    check_cuda(cudaMemcpyAsync(my_slot, mine.data(), mine.size(), cudaMemcpyHostToDevice, impl_->stream),
               "cudaMemcpyAsync");
  check_nccl(ncclAllGather(my_slot, data.ptr, widest, ncclUint8, impl_->comm, impl_->stream), "ncclAllGather");
  std::vector<std::byte> host(widest * static_cast<std::size_t>(size_));
  check_cuda(cudaMemcpyAsync(host.data(), data.ptr, host.size(), cudaMemcpyDeviceToHost, impl_->stream),
             "cudaMemcpyAsync");
  impl_->sync();
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(size_));
  for (std::size_t r = 0; r < out.size(); ++r)
    out[r].assign(host.begin() + static_cast<std::ptrdiff_t>(r * widest),
                  host.begin() + static_cast<std::ptrdiff_t>(r * widest + static_cast<std::size_t>(all_sizes[r])));
  return out;
}

std::vector<std::byte> NcclGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require_root(root, size_);
  return all_gather(rank_ == root ? bytes : std::span<const std::byte>())[static_cast<std::size_t>(root)];
}

}  // namespace shardckpt
