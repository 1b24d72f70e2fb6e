module;
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
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

// Between ncclGroupStart and ncclGroupEnd, also when a call in between throws: a group left open
// would swallow every later NCCL call of the thread.
class GroupCall {
 public:
  GroupCall() { check_nccl(ncclGroupStart(), "ncclGroupStart"); }
  GroupCall(const GroupCall&) = delete;
  GroupCall& operator=(const GroupCall&) = delete;
  ~GroupCall() {
    if (open_) ncclGroupEnd();
  }
  void end() {
    open_ = false;
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  bool open_ = true;
};

}  // namespace

// The communicator, its stream, and device and pinned scratch memory for the metadata collectives:
// allocated when the group is made and grown (doubling) only when a collective needs more, so that
// saves over the group do not allocate device memory once the first has run.
struct NcclGroup::Impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  bool failed = false;  // a collective failed: the communicator is aborted, not destroyed
  void* scratch = nullptr;
  std::byte* host = nullptr;
  std::size_t scratch_bytes = 0;  // of `scratch` and of `host` alike

  static constexpr std::size_t initial_scratch = std::size_t{1} << 20;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    cudaSetDevice(device);
    if (comm) failed ? ncclCommAbort(comm) : ncclCommDestroy(comm);
    if (stream) cudaStreamDestroy(stream);
    cudaFree(scratch);
    cudaFreeHost(host);
  }

  void use() const { check_cuda(cudaSetDevice(device), "cudaSetDevice"); }

  // Makes the stream and the first scratch memory (after `device` is set).
  void start() {
    use();
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    reserve(initial_scratch);
  }

  // At least `bytes` of device scratch and of pinned host memory.
  void reserve(std::size_t bytes) {
    if (bytes <= scratch_bytes) return;
    const std::size_t n = std::max(bytes, 2 * scratch_bytes);
    cudaFree(std::exchange(scratch, nullptr));
    cudaFreeHost(std::exchange(host, nullptr));
    scratch_bytes = 0;
    check_cuda(cudaMalloc(&scratch, n), "cudaMalloc (collective scratch)");
    void* h = nullptr;
    check_cuda(cudaHostAlloc(&h, n, cudaHostAllocDefault), "cudaHostAlloc (collective scratch)");
    host = static_cast<std::byte*>(h);
    scratch_bytes = n;
  }

  // Waits for the stream; a communicator that reports an error (a peer failed, say) is aborted
  // rather than waited on forever.
  void sync() {
    for (;;) {
      const cudaError_t rc = cudaStreamQuery(stream);
      if (rc == cudaSuccess) return;
      if (rc != cudaErrorNotReady) {
        failed = true;
        check_cuda(rc, "cudaStreamQuery");
      }
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) {
        failed = true;
        check_nccl(async, "a collective (the communicator reported an error)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

int NcclGroup::devices() noexcept { return CudaEngine::devices(); }

NcclGroup::NcclGroup(ProcessGroup& bootstrap, int device) : impl_(std::make_unique<Impl>()) {
  rank_ = bootstrap.rank();
  size_ = bootstrap.size();
  // Every rank learns whether all could start before any enters ncclCommInitRank, which would wait
  // for a rank that failed (no device, say) forever. Each sends [started][rank 0's id].
  ncclUniqueId id{};
  std::string why;
  try {
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    impl_->device = device;
    impl_->start();
  } catch (const Error& e) {
    why = e.what();
  }
  std::vector<std::byte> mine(1 + sizeof id);
  mine[0] = std::byte{why.empty()};
  std::memcpy(mine.data() + 1, &id, sizeof id);
  const std::vector<std::vector<std::byte>> all = all_gather_of(bootstrap, mine);
  std::string failed;
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].size() != mine.size() || all[r][0] != std::byte{1}) failed += cat(failed.empty() ? "" : ", ", r);
  require(failed.empty(), Errc::collective, "an NCCL group of ", size_, " ranks cannot start: ranks failed: ", failed,
          why.empty() ? "" : cat(" (this rank: ", why, ")"));
  std::memcpy(&id, all[0].data() + 1, sizeof id);
  check_nccl(ncclCommInitRank(&impl_->comm, size_, id, rank_), "ncclCommInitRank");
}

std::unique_ptr<ProcessGroup> NcclGroup::split(int color, int key) {
  impl_->use();
  std::unique_ptr<NcclGroup> part(new NcclGroup());
  part->impl_ = std::make_unique<Impl>();
  part->impl_->device = impl_->device;
  part->impl_->start();
  check_nccl(ncclCommSplit(impl_->comm, color, key, &part->impl_->comm, nullptr), "ncclCommSplit");
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
  impl_->use();
  GroupCall group;
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
  group.end();
  impl_->sync();
}

NcclGroup::~NcclGroup() = default;

bool NcclGroup::supports_background() const { return false; }

void NcclGroup::barrier() {
  impl_->use();
  check_cuda(cudaMemsetAsync(impl_->scratch, 0, sizeof(std::int32_t), impl_->stream), "cudaMemsetAsync");
  check_nccl(ncclAllReduce(impl_->scratch, impl_->scratch, 1, ncclInt32, ncclSum, impl_->comm, impl_->stream),
             "ncclAllReduce");
  impl_->sync();
}

std::vector<std::vector<std::byte>> NcclGroup::all_gather(std::span<const std::byte> mine) {
  Impl& m = *impl_;
  m.use();
  const auto ranks = static_cast<std::size_t>(size_);
  // Sizes first (through the pinned scratch), then every rank's bytes padded to the largest.
  m.reserve(2 * sizeof(std::int64_t) * ranks);
  auto* sizes = static_cast<std::int64_t*>(m.scratch);
  auto* host_sizes = reinterpret_cast<std::int64_t*>(m.host);
  host_sizes[ranks] = static_cast<std::int64_t>(mine.size());
  check_cuda(cudaMemcpyAsync(sizes + rank_, host_sizes + ranks, sizeof(std::int64_t), cudaMemcpyHostToDevice, m.stream),
             "cudaMemcpyAsync");
  check_nccl(ncclAllGather(sizes + rank_, sizes, 1, ncclInt64, m.comm, m.stream), "ncclAllGather");
  check_cuda(cudaMemcpyAsync(host_sizes, sizes, sizeof(std::int64_t) * ranks, cudaMemcpyDeviceToHost, m.stream),
             "cudaMemcpyAsync");
  m.sync();
  const std::vector<std::int64_t> all_sizes(host_sizes, host_sizes + ranks);
  const auto widest = static_cast<std::size_t>(*std::max_element(all_sizes.begin(), all_sizes.end()));
  std::vector<std::vector<std::byte>> out(ranks);
  if (widest == 0) return out;
  m.reserve(widest * ranks);
  auto* data = static_cast<std::byte*>(m.scratch);
  std::byte* my_slot = data + widest * static_cast<std::size_t>(rank_);
  if (!mine.empty()) {
    std::memcpy(m.host, mine.data(), mine.size());
    check_cuda(cudaMemcpyAsync(my_slot, m.host, mine.size(), cudaMemcpyHostToDevice, m.stream), "cudaMemcpyAsync");
  }
  check_nccl(ncclAllGather(my_slot, data, widest, ncclUint8, m.comm, m.stream), "ncclAllGather");
  check_cuda(cudaMemcpyAsync(m.host, data, widest * ranks, cudaMemcpyDeviceToHost, m.stream), "cudaMemcpyAsync");
  m.sync();
  for (std::size_t r = 0; r < ranks; ++r)
    out[r].assign(m.host + r * widest, m.host + r * widest + static_cast<std::size_t>(all_sizes[r]));
  return out;
}

std::vector<std::byte> NcclGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require_root(root, size_);
  return all_gather(rank_ == root ? bytes : std::span<const std::byte>())[static_cast<std::size_t>(root)];
}

}  // namespace shardckpt
