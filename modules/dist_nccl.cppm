// shardckpt.dist.nccl: a ProcessGroup over NCCL on CUDA devices (built when CUDA and NCCL are
// found). NCCL moves device memory only, so each collective stages its few bytes of metadata
// through a device buffer; tensor data never travels through the group.
module;
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>
export module shardckpt.dist.nccl;
import shardckpt.core;
import shardckpt.views;
import shardckpt.dist;
import shardckpt.cuda;

export namespace shardckpt {

class NcclGroup final : public ProcessGroup {
 public:
  // Number of CUDA devices this process can use; 0 without a driver or device.
  static int devices() noexcept;
  // Collective over `bootstrap`: rank 0 makes the NCCL id, the bootstrap group shares it, and each
  // rank joins on `device`. Throws Errc::collective when CUDA or NCCL fail (no device, say).
  NcclGroup(ProcessGroup& bootstrap, int device);
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override;
  // ncclCommSplit of this group's communicator, on the same device.
  std::unique_ptr<ProcessGroup> split(int color, int key) override;
  // One ncclBroadcast per member, in place, in one NCCL group: device memory of this group's device.
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override;
  bool moves(MemorySpace space) const override;
  // No: NCCL collectives on a background thread can deadlock with the trainer's on the same device.
  bool supports_background() const override;
  std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) override;

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;

 private:
  NcclGroup() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace shardckpt
