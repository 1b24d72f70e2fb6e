module;
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
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
  describe();
}

MpiGroup::MpiGroup(MPI_Comm owned, Adopt) : comm_(owned) { describe(); }

void MpiGroup::describe() {
  // Errors come back as codes (and become Error) instead of aborting the job.
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "Comm_size");
}

std::unique_ptr<ProcessGroup> MpiGroup::split(int color, int key) {
  MPI_Comm part = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(comm_, color, key, &part), "Comm_split");
  return std::unique_ptr<ProcessGroup>(new MpiGroup(part, Adopt{}));
}

bool MpiGroup::supports_background() const {
  int level = MPI_THREAD_SINGLE;
  return MPI_Query_thread(&level) == MPI_SUCCESS && level == MPI_THREAD_MULTIPLE;
}

void MpiGroup::all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) {
  require_row_counts(rows, counts, size_);
  require(rows.space().host_accessible(), Errc::invalid_argument, "an MPI group moves host memory, not ",
          memory_space_text(rows.space()), " memory");
  require(rows.row_bytes() <= INT32_MAX && rows.rows() <= INT32_MAX, Errc::invalid_argument, "gathering ",
          rows.rows(), " rows of ", rows.row_bytes(), " bytes exceeds MPI's int counts");
  std::vector<int> n, at;
  for (std::int64_t c : counts) {
    at.push_back(n.empty() ? 0 : at.back() + n.back());
    n.push_back(static_cast<int>(c));
  }
  MPI_Datatype row = MPI_DATATYPE_NULL;
  check_mpi(MPI_Type_contiguous(static_cast<int>(rows.row_bytes()), MPI_BYTE, &row), "Type_contiguous");
  check_mpi(MPI_Type_commit(&row), "Type_commit");
  const int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, rows.data(), n.data(), at.data(), row, comm_);
  MPI_Type_free(&row);
  check_mpi(rc, "Allgatherv");
}

MpiGroup::~MpiGroup() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiGroup::barrier() { check_mpi(MPI_Barrier(comm_), "Barrier"); }

namespace {

// The byte counts of every rank and where each starts in the concatenation.
struct Layout {
  std::vector<int> counts, displs;
  std::int64_t total = 0;
};

Layout layout_of(std::vector<int> counts) {
  Layout l{std::move(counts), {}, 0};
  for (int c : l.counts) {
    l.displs.push_back(static_cast<int>(l.total));
    l.total += c;
  }
  require(l.total <= INT32_MAX, Errc::invalid_argument, "a collective of ", l.total, " bytes exceeds MPI's int counts");
  return l;
}

int count_of(std::span<const std::byte> mine) {
  require(mine.size() <= INT32_MAX, Errc::invalid_argument, "a collective of ", mine.size(),
          " bytes exceeds MPI's int counts");
  return static_cast<int>(mine.size());
}

std::vector<std::vector<std::byte>> cut(const std::vector<std::byte>& all, const Layout& l) {
  std::vector<std::vector<std::byte>> out(l.counts.size());
  for (std::size_t r = 0; r < out.size(); ++r) {
    const auto* first = all.data() + l.displs[r];
    out[r].assign(first, first + l.counts[r]);
  }
  return out;
}

}  // namespace

std::vector<std::vector<std::byte>> MpiGroup::all_gather(std::span<const std::byte> mine) {
  const int count = count_of(mine);
  std::vector<int> counts(static_cast<std::size_t>(size_));
  check_mpi(MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm_), "Allgather");
  const Layout l = layout_of(std::move(counts));
  std::vector<std::byte> all(static_cast<std::size_t>(l.total));
  check_mpi(MPI_Allgatherv(mine.data(), count, MPI_BYTE, all.data(), l.counts.data(), l.displs.data(), MPI_BYTE, comm_),
            "Allgatherv");
  return cut(all, l);
}

std::vector<std::vector<std::byte>> MpiGroup::gather(std::span<const std::byte> mine, int root) {
  require_root(root, size_);
  const int count = count_of(mine);
  std::vector<int> counts(rank_ == root ? static_cast<std::size_t>(size_) : 0);
  check_mpi(MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, root, comm_), "Gather");
  // Point to point, straight into each rank's buffer: a Gatherv would need one buffer of everything
  // and then a copy of it, twice the memory at the one rank that holds every plan.
  constexpr int tag = 0x5c;
  if (rank_ != root) {
    check_mpi(MPI_Send(mine.data(), count, MPI_BYTE, root, tag, comm_), "Send");
    return {};
  }
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    auto& buf = out[static_cast<std::size_t>(r)];
    if (r == root) {
      buf.assign(mine.begin(), mine.end());
      continue;
    }
    buf.resize(static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]));
    check_mpi(MPI_Recv(buf.data(), counts[static_cast<std::size_t>(r)], MPI_BYTE, r, tag, comm_, MPI_STATUS_IGNORE),
              "Recv");
  }
  return out;
}

std::vector<std::byte> MpiGroup::broadcast(std::span<const std::byte> bytes, int root) {
  require_root(root, size_);
  std::int64_t n = rank_ == root ? static_cast<std::int64_t>(bytes.size()) : 0;
  check_mpi(MPI_Bcast(&n, 1, MPI_INT64_T, root, comm_), "Bcast");
  require(n <= INT32_MAX, Errc::invalid_argument, "broadcast of ", n, " bytes exceeds MPI's int counts");
  std::vector<std::byte> out(static_cast<std::size_t>(n));
  if (rank_ == root) out.assign(bytes.begin(), bytes.end());
  check_mpi(MPI_Bcast(out.data(), static_cast<int>(n), MPI_BYTE, root, comm_), "Bcast");
  return out;
}

}  // namespace shardckpt
