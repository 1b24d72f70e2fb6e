// Tests for process groups: splitting a thread group into subgroups, gathering rows in place
// (what data-parallel copies use to hand each other the rows each read), and aborts that reach
// every group split from an aborted one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>
import shardckpt;

using namespace shardckpt;

namespace {

struct Probe : ProcessGroup {
  using ProcessGroup::all_gather_of;
};

}  // namespace

TEST(Groups, SplitRanksMembersByKeyWithinEachColor) {
  run_ranks(6, [](ProcessGroup& g) {
    // Colors 0 and 1 by parity; keys reverse the order within a color.
    const std::unique_ptr<ProcessGroup> part = g.split(g.rank() % 2, -g.rank());
    EXPECT_EQ(part->size(), 3);
    EXPECT_EQ(part->rank(), 2 - g.rank() / 2);
    const std::byte mine{static_cast<unsigned char>(g.rank())};
    const auto all = Probe::all_gather_of(*part, std::span(&mine, 1));
    for (int r = 0; r < 3; ++r)  // member r of color c is rank c + 2 * (2 - r)
      EXPECT_EQ(all[static_cast<std::size_t>(r)][0], std::byte(g.rank() % 2 + 2 * (2 - r)));
    // The parent group still works, and its rounds do not mix with the part's.
    g.barrier();
    part->barrier();
    const std::unique_ptr<ProcessGroup> again = part->split(0, part->rank());
    EXPECT_EQ(again->size(), 3);
  });
}

TEST(Groups, AllGatherRowsFillsEveryMembersRowsInPlace) {
  run_ranks(3, [](ProcessGroup& g) {
    // Member i owns counts[i] rows of 3 floats, in member order; the rest of its buffer is garbage.
    const std::vector<std::int64_t> counts{2, 0, 3};
    std::vector<float> rows(5 * 3, -1.0f);
    std::int64_t first = 0;
    for (int i = 0; i < g.rank(); ++i) first += counts[static_cast<std::size_t>(i)];
    for (std::int64_t r = first; r < first + counts[static_cast<std::size_t>(g.rank())]; ++r)
      for (int c = 0; c < 3; ++c) rows[static_cast<std::size_t>(r * 3 + c)] = static_cast<float>(r * 10 + c);
    const MutTensorView view = MutTensorView::unchecked(rows.data(), DType::f32, {5, 3});
    const BufferStats before = buffer_stats();
    g.all_gather_rows(view, counts);
    EXPECT_EQ(buffer_stats().allocations, before.allocations);
    for (std::int64_t r = 0; r < 5; ++r)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(rows[static_cast<std::size_t>(r * 3 + c)], static_cast<float>(r * 10 + c));
  });
}

TEST(Groups, BadRowCountsFailEveryMemberTheSameWay) {
  std::atomic<int> failed{0};
  run_ranks(2, [&](ProcessGroup& g) {
    std::vector<float> rows(4);
    const MutTensorView view = MutTensorView::unchecked(rows.data(), DType::f32, {4});
    // Member 1's counts add up to 5 rows, not 4.
    const std::vector<std::int64_t> counts = g.rank() == 1 ? std::vector<std::int64_t>{2, 3} : std::vector<std::int64_t>{2, 2};
    try {
      g.all_gather_rows(view, counts);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("the counts add up to 5 rows but the tensor has 4"), std::string::npos)
          << e.what();
      ++failed;
    }
  });
  EXPECT_EQ(failed.load(), 2);
}

TEST(Groups, DeviceRowsAreNotForAThreadGroup) {
  const auto device = std::make_shared<EmulatedDevice>();
  SharedBuffer rows = device->allocate_device(DType::f32, {2});
  SoloGroup solo;
  EXPECT_FALSE(solo.moves(rows.space()));
  run_ranks(1, [&](ProcessGroup& g) {
    EXPECT_FALSE(g.moves(rows.space()));
    EXPECT_THROW(g.all_gather_rows(rows.mut_view(), std::vector<std::int64_t>{2}), Error);
  });
}

TEST(Groups, AnAbortReachesGroupsSplitFromTheAbortedOne) {
  std::atomic<int> collective{0};
  try {
    run_ranks(4, [&](ProcessGroup& g) {
      const std::unique_ptr<ProcessGroup> part = g.split(g.rank() / 2, g.rank());
      g.barrier();  // every rank holds its part before rank 3 fails
      if (g.rank() == 3) throw Error(Errc::io, "rank 3 fails");
      try {
        part->barrier();  // rank 2 waits for rank 3 in the part, which never comes
        part->barrier();
      } catch (const Error& e) {
        if (e.code() == Errc::collective) ++collective;
        throw;
      }
    });
  } catch (const Error& e) {
    // Rank 2 is the lowest failing rank: the abort reached it in the part it shares with rank 3.
    EXPECT_EQ(e.code(), Errc::collective);
    EXPECT_NE(std::string(e.what()).find("rank 3 failed: rank 3 fails"), std::string::npos) << e.what();
  }
  EXPECT_GE(collective.load(), 1);
}
