// Real multi-process tests, run as `mpirun -np 4`: 4 MPI processes save one checkpoint and load it
// at another layout, replicas write once, and a validation failure stops every process before any
// byte is written.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "test_support.hpp"
import shardckpt;
import shardckpt.dist.mpi;
import shardckpt.demo;

using namespace shardckpt;

namespace {

// One scratch directory for the whole job: rank 0 makes it and tells the others.
std::filesystem::path shared_dir() {
  static std::filesystem::path dir = [] {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::string name(4096, '\0');
    if (rank == 0) {
      std::string pattern = (std::filesystem::temp_directory_path() / "shardckpt-mpi-XXXXXX").string();
      name = ::mkdtemp(pattern.data());
      name.resize(4096, '\0');
    }
    MPI_Bcast(name.data(), 4096, MPI_CHAR, 0, MPI_COMM_WORLD);
    return std::filesystem::path(name.c_str());
  }();
  return dir;
}

demo::ModelConfig small_model() {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  c.dims = {.heads = 4, .head_dim = 4, .groups = 4, .state = 4, .householder = 2};
  c.cols = 32;
  return c;
}

std::int64_t global_mismatches(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& file) {
  MpiGroup group(MPI_COMM_WORLD);
  const demo::Verification v =
      demo::verify(c, {}, group.rank(), demo::request(c, l, group.rank()),
                   load(file, demo::request(c, l, group.rank()), group));
  EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
  std::int64_t total = 0;
  MPI_Allreduce(&v.mismatches, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

}  // namespace

TEST(Mpi, FourProcessesSaveOneCheckpointAndLoadAtAnotherLayout) {
  MpiGroup group(MPI_COMM_WORLD);
  ASSERT_EQ(group.size(), 4) << "run with mpirun -np 4";
  const auto c = small_model();
  const auto file = shared_dir() / "c.h5";
  demo::RankModel m = demo::build_rank(c, {2, 2, 8, 1}, group.rank());
  save(m.state, file, group);
  EXPECT_EQ(global_mismatches(c, {1, 4, 2, 1}, file), 0);
  EXPECT_EQ(global_mismatches(c, {4, 1, 0, 1}, file), 0);
}

// DP 2 with the Adam state of a distributed optimizer, saved by every replica's share and loaded
// at DP 4 with each shard read once per replica group (the rows handed around by MPI_Allgatherv).
TEST(Mpi, ReplicasShareWritesAndReadsAndTheDistributedOptimizerReshards) {
  MpiGroup group(MPI_COMM_WORLD);
  const auto c = small_model();
  const demo::Training adam{.adam = true, .distributed = true};
  const auto file = shared_dir() / "dp.h5";
  demo::RankModel m = demo::build_rank(c, {1, 2, 8, 2}, group.rank(), adam);
  save(m.state, file, group);
  const demo::Layout l{2, 1, 0, 2};
  StateDict model = demo::with_destinations(demo::request(c, l, group.rank(), adam));
  const demo::RankCoord at = demo::coord_of(l, group.rank());
  const std::unique_ptr<ProcessGroup> replicas = group.split(at.tp * l.gtp + at.gtp, at.dp);
  const Values values = load_into(file, model, group, {}, *replicas);
  const demo::Verification v = demo::verify(c, adam, group.rank(), model, values);
  EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
  EXPECT_GT(v.values, 0);
}

TEST(Mpi, ValidationFailureStopsEveryProcessBeforeAnyByteIsWritten) {
  MpiGroup group(MPI_COMM_WORLD);
  const auto file = shared_dir() / "bad.h5";
  SharedBuffer b = SharedBuffer::zeros(DType::f32, {4, 2});
  StateDict s;
  // Ranks 0 and 1 both claim rows [0, 4): an overlap; rows [12, 16) are nobody's.
  s.add(ShardedTensor::of("t", b, {16, 2}, {std::max(0, group.rank() - 1) * 4, 0}));
  try {
    save(s, file, group);
    ADD_FAILURE() << "the save went through";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::tiling);
    EXPECT_NE(std::string(e.what()).find("saved by both rank 0 and rank 1"), std::string::npos) << e.what();
  }
  group.barrier();
  EXPECT_FALSE(std::filesystem::exists(file));
  EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(file).parent_path()).empty());
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {  // one report for the job
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(shared_dir());
  MPI_Finalize();
  return worst;
}
