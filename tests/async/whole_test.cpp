// Async saves whose bytes fit the saver's budget: staged whole before save_async returns (the saved
// weights are those of the call, whatever the caller does next), the budget allocated once and
// never grown, a failure in the background as every rank's outcome, one save in flight per saver, a
// budget the process cannot hold refused.
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

#include "support.hpp"

// The caller changes its weights as soon as save_async returns: the checkpoint holds the weights as
// they were when it was called, and wait_staged() has nothing to wait for.
TEST(AsyncSave, StagedWholeBeforeItReturnsAndSavesTheWeightsAsTheyWere) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  for (const bool on_device : {false, true}) {
    Gate planning;
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      const auto device = std::make_shared<EmulatedDevice>();
      const demo::ShardMemory where = on_device ? demo::ShardMemory{MemoryKind::device, device} : demo::ShardMemory{};
      demo::RankModel m = demo::build_rank(c, l, g.rank(), {}, where);
      Saver saver(g, {.engine = on_device ? device : nullptr, .save = held_at(&planning, nullptr)});
      AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
      EXPECT_TRUE(pending.staged());  // before the background has even planned
      EXPECT_FALSE(pending.done());
      pending.wait_staged();
      // Train on: every shard is overwritten while the save is in flight.
      for (std::size_t i = 0; i < m.state.params().size(); ++i)
        if (const MutTensorView shard = m.state.mut_shard(i).mut_view(); !shard.empty()) scribble(shard, device.get());
      g.barrier();
      if (g.rank() == 0) planning.open();
      pending.wait();
      EXPECT_TRUE(pending.done());
      EXPECT_GT(saver.staging_bytes(), 0u);
    });
    EXPECT_EQ(host_mismatches(c, {1, 4, 4, 1}, dir / "a.h5"), 0) << (on_device ? "device" : "host");
  }
}

// The budget is the pool's unless asked for more, allocated and faulted in once, when the saver is
// made (or at reserve()), so that no async save allocates, the first included; a state larger than
// the budget no longer fails but streams through it.
TEST(AsyncSave, TheBudgetIsAllocatedOnceAndNeverGrows) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 0, 1};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    const std::size_t budget = std::max<std::size_t>(2 * static_cast<std::size_t>(m.shard_bytes), 2048);
    Saver saver(g, {.staging_buffer_bytes = 1024, .async_host_bytes = budget});
    EXPECT_EQ(saver.async_host_bytes(), budget);
    EXPECT_EQ(saver.staging_bytes(), budget);  // held from the start, without an engine too
    // Adam's state makes the rank's bytes larger than the budget: they stream, in place.
    demo::RankModel bigger = demo::build_rank(c, l, g.rank(), {.adam = true});
    ASSERT_GT(static_cast<std::size_t>(bigger.shard_bytes), saver.async_host_bytes());
    g.barrier();
    const BufferStats before = buffer_stats();  // no rank allocates between the barriers
    for (int i = 0; i < 3; ++i) saver.save_async(m.state, dir / "a.h5").wait();
    saver.reserve();  // held already: nothing more
    saver.save_async(bigger.state, dir / "b.h5").wait();
    g.barrier();
    const BufferStats after = buffer_stats();
    g.barrier();
    EXPECT_EQ(after.allocations, before.allocations);
    EXPECT_EQ(saver.staging_bytes(), budget);
    // Asked for later: nothing until reserve(), which allocates once.
    Saver later(g, {.staging_buffer_bytes = 1024, .async_host_bytes = budget, .reserve = false});
    EXPECT_EQ(later.staging_bytes(), 0u);
    later.reserve();
    EXPECT_EQ(later.staging_bytes(), budget);
    g.barrier();
    const BufferStats reserved = buffer_stats();
    later.reserve();
    later.save_async(m.state, dir / "c.h5").wait();
    g.barrier();
    EXPECT_EQ(buffer_stats().allocations, reserved.allocations);
    // Or by the first async save staged whole.
    Saver lazy(g, {.staging_buffer_bytes = 1024, .async_host_bytes = budget, .reserve = false});
    lazy.save_async(m.state, dir / "d.h5").wait();
    EXPECT_EQ(lazy.staging_bytes(), budget);
    // Never below the pool.
    Saver small(g, {.staging_buffer_bytes = 1024, .async_host_bytes = 100});
    EXPECT_EQ(small.async_host_bytes(), 2048u);
  });
  EXPECT_EQ(host_mismatches(c, {2, 1, 0, 1}, dir / "a.h5"), 0);
  EXPECT_EQ(host_mismatches(c, {2, 1, 0, 1}, dir / "b.h5", {.adam = true}), 0);
}

TEST(AsyncSave, AFailureInTheBackgroundIsEveryRanksOutcomeAndCommitsNothing) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 0, 1};
  std::atomic<int> failed{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    Saver saver(g);
    AsyncSave pending = saver.save_async(m.state, dir / "missing" / "a.h5");
    try {
      pending.wait();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::io) << e.what();
      ++failed;
    }
    // The outcome stays: waiting again says the same.
    EXPECT_THROW(pending.wait(), Error);
    EXPECT_TRUE(pending.staged());
  });
  EXPECT_EQ(failed.load(), 2);
  EXPECT_FALSE(std::filesystem::exists(dir / "missing"));
}

// A second save waits for the first: one save in flight per saver.
TEST(AsyncSave, OneSaveInFlightPerSaver) {
  ScratchDir dir;
  const auto c = tiny_model();
  run_ranks(2, [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, {1, 2, 0, 1}, g.rank());
    Saver saver(g);
    AsyncSave first = saver.save_async(m.state, dir / "a.h5");
    AsyncSave second = saver.save_async(m.state, dir / "b.h5");
    EXPECT_TRUE(first.done());
    first.wait();
    second.wait();
    // The caller's own collectives never meet the saver's.
    g.barrier();
  });
  EXPECT_EQ(host_mismatches(c, {2, 1, 0, 1}, dir / "a.h5"), 0);
  EXPECT_EQ(host_mismatches(c, {2, 1, 0, 1}, dir / "b.h5"), 0);
}

namespace {

// This process's address space in bytes (/proc/self/statm: pages).
std::size_t mapped_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  return pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

// The soft RLIMIT_AS set to `bytes` for one scope.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(std::size_t bytes) {
    ::getrlimit(RLIMIT_AS, &old_);
    rlimit l = old_;
    l.rlim_cur = bytes;
    ::setrlimit(RLIMIT_AS, &l);
  }
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;
  ~AddressSpaceLimit() { ::setrlimit(RLIMIT_AS, &old_); }

 private:
  rlimit old_{};
};

Errc saver_error(std::size_t budget, std::string& message) {
  SoloGroup solo;
  try {
    Saver saver(solo, {.async_host_bytes = budget});
  } catch (const Error& e) {
    message = e.what();
    return e.code();
  }
  return Errc::internal;
}

}  // namespace

// A budget the process can never hold is refused when the saver is made, naming the budget and the
// limit, before a byte is mapped: more than physical memory (which locking it would take, page by
// page, until the OOM killer came), any size_t, more than RLIMIT_AS. One under RLIMIT_AS that the
// address space left cannot map is Errc::resources too, at the save that allocates it.
TEST(AsyncSave, ABudgetThisProcessCannotHoldIsRefusedWhenTheSaverIsMade) {
  const std::size_t physical =
      static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::string message;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(saver_error(physical + 1, message), Errc::resources);
  EXPECT_NE(message.find(cat("budget of ", physical + 1, " bytes")), std::string::npos) << message;
  EXPECT_NE(message.find(cat(physical, " bytes of this machine's physical memory")), std::string::npos) << message;
  EXPECT_EQ(saver_error(std::size_t{1} << 40, message), Errc::resources);
  EXPECT_EQ(saver_error(~std::size_t{0}, message), Errc::resources);
  EXPECT_NE(message.find("18446744073709551615 bytes"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));  // nothing was mapped
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "the RLIMIT_AS part: ASan's shadow memory maps terabytes, so no address-space limit lets a "
                  "sanitized process run (the plain build checks it)";
#endif
#endif
  {
    const std::size_t limit = mapped_bytes() + (std::size_t{64} << 20);
    const AddressSpaceLimit as(limit);
    EXPECT_EQ(saver_error(limit + 1, message), Errc::resources);
    EXPECT_NE(message.find(cat("RLIMIT_AS (address space) limit of ", limit, " bytes")), std::string::npos) << message;
    // Under the limit, more than the address space left: the saver that maps it fails on resources,
    // when it is made or (made with reserve = false) at the save that maps it.
    const std::size_t budget = limit - (std::size_t{1} << 20);
    SoloGroup solo;
    try {
      Saver saver(solo, {.async_host_bytes = budget});
      ADD_FAILURE() << "a budget the address space cannot hold was allocated";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::resources) << e.what();
      EXPECT_NE(std::string(e.what()).find("could not be allocated"), std::string::npos) << e.what();
    }
    ScratchDir dir;
    Saver saver(solo, {.async_host_bytes = budget, .reserve = false});
    StateDict s;
    SharedBuffer t = SharedBuffer::zeros(DType::f32, {4, 4});
    s.add(ShardedTensor::of("t", TensorRef(t), {4, 4}, {0, 0}));
    try {
      saver.save_async(s, dir / "a.h5").wait();
      ADD_FAILURE() << "a budget the address space cannot hold was allocated";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::resources) << e.what();
      EXPECT_NE(std::string(e.what()).find("could not be allocated"), std::string::npos) << e.what();
    }
  }
}
