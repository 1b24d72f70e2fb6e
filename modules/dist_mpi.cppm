// shardckpt.dist.mpi: a ProcessGroup over an MPI communicator the user hands in (built when MPI is
// found). The caller initializes and finalizes MPI; the group duplicates the communicator so that
// the library's messages never mix with the application's. It never initializes or finalizes MPI.
module;
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>
export module shardckpt.dist.mpi;
import shardckpt.core;
import shardckpt.views;
import shardckpt.dist;

export namespace shardckpt {

class MpiGroup final : public ProcessGroup {
 public:
  // \requires MPI is initialized. Throws Errc::collective when MPI reports an error.
  explicit MpiGroup(MPI_Comm comm);
  MpiGroup(const MpiGroup&) = delete;
  MpiGroup& operator=(const MpiGroup&) = delete;
  ~MpiGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override;
  // MPI_Comm_split of this group's communicator.
  std::unique_ptr<ProcessGroup> split(int color, int key) override;
  // MPI_Allgatherv in place, one row a datatype element.
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override;
  std::vector<std::byte> broadcast(std::span<const std::byte> bytes, int root) override;
  // Only when MPI runs at MPI_THREAD_MULTIPLE.
  bool supports_background() const override;

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::vector<std::byte>> gather(std::span<const std::byte> mine, int root) override;

 private:
  struct Adopt {};
  MpiGroup(MPI_Comm owned, Adopt);
  void describe();
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace shardckpt
