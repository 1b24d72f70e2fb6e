// The NCCL process group and the CUDA copy engine on real devices: metadata collectives, device
// shards saved through a Saver's pinned pool, and a load in place at DP = ranks whose replicas read
// one share each and hand each other their device rows through NCCL; and a group one of whose ranks
// cannot start fails on every rank (this runs anywhere). Without a CUDA device the others skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "test_support.hpp"
import shardckpt;
import shardckpt.cuda;
import shardckpt.dist.nccl;
import shardckpt.demo;

using namespace shardckpt;

namespace {

struct Probe : ProcessGroup {
  using ProcessGroup::all_gather_of;
};

}  // namespace

TEST(Nccl, DeviceShardsSaveAndLoadInPlaceOverNccl) {
  if (NcclGroup::devices() == 0) GTEST_SKIP() << "no CUDA device";
  // One rank per GPU: NCCL does not support two ranks of a communicator on one device. With one
  // GPU the group has one rank and no rows are handed between copies.
  const int ranks = std::min(NcclGroup::devices(), 4);
  std::printf("NCCL group of %d rank%s\n", ranks, ranks == 1 ? " (one GPU: rows are not handed between copies)" : "s");
  testing_support::ScratchDir dir;
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  const demo::Training adam{.adam = true};
  run_ranks(ranks, [&](ProcessGroup& bootstrap) {
    NcclGroup group(bootstrap, bootstrap.rank());
    const std::byte mine[3] = {std::byte(group.rank()), std::byte(7), std::byte(group.rank() + 1)};
    const auto all = Probe::all_gather_of(group, mine);
    // No ASSERT inside a rank: a rank that returned early would leave the others waiting in NCCL.
    EXPECT_EQ(static_cast<int>(all.size()), ranks);
    for (std::size_t r = 0; r < all.size(); ++r) EXPECT_TRUE(all[r].size() == 3 && all[r][2] == std::byte(r + 1)) << r;
    EXPECT_EQ(group.broadcast(mine, 0)[1], std::byte(7));
    group.barrier();

    const auto engine = std::make_shared<CudaEngine>(group.rank());
    const demo::ShardMemory device{MemoryKind::device, engine};
    demo::RankModel m = demo::build_rank(c, {1, ranks, 8, 1}, group.rank(), adam, device);
    Saver saver(group, {.engine = engine, .staging_buffer_bytes = 1 << 20});
    saver.save(m.state, dir / "nccl.h5");

    const demo::Layout at{1, 1, 0, ranks};
    StateDict model = demo::with_destinations(demo::request(c, at, group.rank(), adam), device);
    const std::unique_ptr<ProcessGroup> replicas = group.split(0, group.rank());
    const auto pool = std::make_shared<StagingPool>(engine, 1 << 20);
    const Values values = load_into(dir / "nccl.h5", model, group, {.staging = pool}, *replicas);
    const demo::Verification v = demo::verify(c, adam, group.rank(), model, values, engine.get());
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
  });
}

// A rank that cannot start (here: a device that does not exist, on any machine) fails the group's
// construction on every rank, naming it, instead of leaving the others waiting in ncclCommInitRank.
TEST(Nccl, ARankThatCannotStartFailsEveryRank) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](ProcessGroup& bootstrap) {
    const int device = bootstrap.rank() == 1 ? 1 << 20 : 0;
    try {
      NcclGroup group(bootstrap, device);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::collective);
      errors[static_cast<std::size_t>(bootstrap.rank())] = e.what();
    }
  });
  // Rank 1 failed (rank 0 too, on a machine without a usable GPU).
  for (const std::string& e : errors) {
    const std::string lead = "cannot start: ranks failed: ";
    const std::size_t at = e.find(lead);
    ASSERT_NE(at, std::string::npos) << e;
    const std::string failed = e.substr(at + lead.size(), e.find(" (", at) - at - lead.size());
    EXPECT_TRUE(failed == "1" || failed == "0, 1") << e;
  }
  EXPECT_NE(errors[1].find("(this rank: CUDA cudaSetDevice failed"), std::string::npos) << errors[1];
}

// Exit 77 (Meson's "skipped") when every test skipped, so that a run without a GPU is reported as
// skipped rather than passed.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const auto& unit = *::testing::UnitTest::GetInstance();
  return rc == 0 && unit.skipped_test_count() == unit.test_to_run_count() ? 77 : rc;
}
