// The NCCL process group on a real device. Without a CUDA device (this machine, CI) every test
// skips, and says so.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "test_support.hpp"
import shardckpt;
import shardckpt.dist.nccl;
import shardckpt.demo;

using namespace shardckpt;

TEST(Nccl, CollectivesAndASaveOverNccl) {
  if (NcclGroup::devices() == 0) GTEST_SKIP() << "no CUDA device";
  const int ranks = std::min(NcclGroup::devices(), 4);
  testing_support::ScratchDir dir;
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  const demo::Layout l{1, ranks, 8, 1};
  run_ranks(ranks, [&](ProcessGroup& bootstrap) {
    NcclGroup group(bootstrap, bootstrap.rank());
    const std::byte mine[3] = {std::byte(group.rank()), std::byte(7), std::byte(group.rank() + 1)};
    const auto all = group.all_gather(mine);
    ASSERT_EQ(static_cast<int>(all.size()), ranks);
    for (int r = 0; r < ranks; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)][2], std::byte(r + 1));
    EXPECT_EQ(group.broadcast(mine, 0)[1], std::byte(7));
    group.barrier();
    demo::RankModel m = demo::build_rank(c, l, group.rank());
    save(m.state, dir / "nccl.h5", group);
    const demo::Verification v =
        demo::verify(c, l, group.rank(), load(dir / "nccl.h5", demo::request(c, l, group.rank()), group));
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
  });
}

// Exit 77 (Meson's "skipped") when every test skipped, so that a run without a GPU is reported as
// skipped rather than passed.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const auto& unit = *::testing::UnitTest::GetInstance();
  return rc == 0 && unit.skipped_test_count() == unit.test_to_run_count() ? 77 : rc;
}
