// Tests for the process groups of shardckpt.dist: the collectives of thread ranks, and the
// thread-safe HDF5 that thread ranks need.
#include "support.hpp"

import shardckpt.merge.seam;

TEST(Groups, ThreadGroupCollectivesDeliverEveryRanksBytes) {
  run_ranks(5, [](ProcessGroup& g) {
    const std::byte mine[2] = {std::byte(g.rank()), std::byte(g.rank() * 2)};
    for (int round = 0; round < 50; ++round) {
      const auto all = Probe::all_gather_of(g, mine);
      ASSERT_EQ(all.size(), 5u);
      for (int r = 0; r < 5; ++r) ASSERT_EQ(all[static_cast<std::size_t>(r)][1], std::byte(r * 2));
      const auto b = g.broadcast(mine, round % 5);
      ASSERT_EQ(b[0], std::byte(round % 5));
      const auto at_root = Probe::gather_of(g, mine, round % 5);
      ASSERT_EQ(at_root.size(), g.rank() == round % 5 ? 5u : 0u);
      if (!at_root.empty()) ASSERT_EQ(at_root[4][1], std::byte(8));
      g.barrier();
    }
  });
}

// Thread ranks call HDF5 concurrently: without a thread-safe HDF5 they are refused, one process is not.
TEST(Groups, ThreadRanksNeedAThreadSafeHdf5) {
  EXPECT_TRUE(hdf5_thread_safe());  // Debian's libhdf5 is
  EXPECT_NO_THROW(require_thread_safe_hdf5(false, false));
  EXPECT_NO_THROW(require_thread_safe_hdf5(true, true));
  EXPECT_EQ(testing_support::error_of([&] { require_thread_safe_hdf5(true, false); }).code(), Errc::invalid_argument);
  // what the collectives ask: several thread ranks are threads of one process, one rank is not
  run_ranks(2, [&](ProcessGroup& g) { EXPECT_TRUE(g.threads_of_one_process() && g.size() > 1); });
  SoloGroup solo;
  EXPECT_FALSE(solo.threads_of_one_process() && solo.size() > 1);
}
