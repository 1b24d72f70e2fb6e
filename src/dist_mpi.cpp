module;
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>
module shardckpt.dist.mpi;

namespace shardckpt {
namespace {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(Errc::collective, cat("MPI ", what, " failed: ", std::string(text, static_cast<std::size_t>(len))));
}

}  // namespace

MpiGroup::MpiGroup(MPI_Comm comm) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "Comm_dup");
  // Errors come back as codes (and become Error) instead of aborting the job.
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "Comm_size");
}

MpiGroup::~MpiGroup() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiGroup::barrier() { check_mpi(MPI_Barrier(comm_), "Barrier"); }

std::vector<std::vector<std::byte>> MpiGroup::all_gather(std::span<const std::byte> mine) {
  const auto n = static_cast<std::int64_t>(mine.size());
  require(n <= INT32_MAX, Errc::invalid_argument, "all_gather of ", n, " bytes exceeds MPI's int counts");
  std::vector<int> counts(static_cast<std::size_t>(size_)), displs(static_cast<std::size_t>(size_));
  const int count = static_cast<int>(n);
  check_mpi(MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm_), "Allgather");
  std::int64_t total = 0;
  for (int r = 0; r < size_; ++r) {
    displs[static_cast<std::size_t>(r)] = static_cast<int>(total);
    total += counts[static_cast<std::size_t>(r)];
  }
  require(total <= INT32_MAX, Errc::invalid_argument, "all_gather of ", total, " bytes exceeds MPI's int counts");
  std::vector<std::byte> all(static_cast<std::size_t>(total));
  check_mpi(MPI_Allgatherv(mine.data(), count, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, comm_),
            "Allgatherv");
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    const auto* first = all.data() + displs[static_cast<std::size_t>(r)];
    out[static_cast<std::size_t>(r)].assign(first, first + counts[static_cast<std::size_t>(r)]);
  }
  return out;
}

std::vector<std::byte> MpiGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require(root >= 0 && root < size_, Errc::invalid_argument, "broadcast root ", root, " is outside a group of ", size_);
  std::int64_t n = rank_ == root ? static_cast<std::int64_t>(bytes.size()) : 0;
  check_mpi(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm_), "Bcast");
  require(n <= INT32_MAX, Errc::invalid_argument, "broadcast of ", n, " bytes exceeds MPI's int counts");
  std::vector<std::byte> out(static_cast<std::size_t>(n));
  if (rank_ == root) out.assign(bytes.begin(), bytes.end());
  check_mpi(MPI_Bcast(out.data(), static_cast<int>(n), MPI_BYTE, root, comm_), "Bcast");
  return out;
}

}  // namespace shardckpt
