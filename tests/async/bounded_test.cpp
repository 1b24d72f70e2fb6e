// Async saves larger than the saver's budget: save_async returns before a byte is copied, the bytes
// stream device -> pinned -> file (host -> file) in the background through the budget while the
// caller trains on, wait_staged() returns once the last byte has left the shards (before the
// commit), and a failure while streaming, or a shard changed too early, fails the save on every rank.
#include <algorithm>

#include "support.hpp"

namespace {

// Index of the last entry named `what` in `calls` (-1 for none).
std::ptrdiff_t last_of(const std::vector<std::string>& calls, const std::string& what) {
  const auto it = std::find(calls.rbegin(), calls.rend(), what);
  return it == calls.rend() ? -1 : calls.rend() - it - 1;
}

}  // namespace

// One device shard of 8 buffers' worth through a budget of 2: nothing moves before save_async has
// returned; then the copy of each buffer is enqueued before the previous one is written, every write
// follows a wait for its copy, and wait_staged() returns after the last copy landed, before the commit.
TEST(BoundedAsyncSave, ReturnsBeforeAnyByteIsCopiedAndStreamsThroughTheBudget) {
  ScratchDir dir;
  const auto device = std::make_shared<EmulatedDevice>();
  const auto engine = std::make_shared<Recording>(*device);
  CountingShard t(*device);
  StateDict s = t.state();
  Gate planning, committing;
  SaverOptions o{.engine = engine, .staging_buffer_bytes = 512, .save = held_at(&planning, &committing)};
  o.save.progress = [&](std::int64_t) { engine->note("write"); };
  SoloGroup solo;
  Saver saver(solo, o);  // a budget of 1 KiB: 2 buffers of 8 rows
  ASSERT_EQ(saver.async_host_bytes(), 1024u);
  const EngineStats before = device->stats();
  AsyncSave pending = saver.save_async(s, dir / "a.h5");
  engine->note("returned");
  EXPECT_FALSE(pending.staged());
  planning.open();
  pending.wait_staged();
  engine->note("staged");
  EXPECT_FALSE(pending.done());  // held before the commit
  committing.open();
  pending.wait();
  const std::vector<std::string> calls = engine->calls();
  ASSERT_GE(calls.size(), 5u);
  EXPECT_EQ(calls[0], "returned");
  EXPECT_EQ((std::vector<std::string>(calls.begin() + 1, calls.begin() + 5)),
            (std::vector<std::string>{"to_host", "to_host", "wait", "write"}));
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "to_host"), 8);
  EXPECT_EQ(std::count(calls.begin(), calls.end(), "write"), 8);
  for (std::size_t i = 1, waits = 0; i < calls.size(); ++i) {
    if (calls[i] == "wait") ++waits;
    if (calls[i] != "write") continue;
    EXPECT_GT(waits, 0u) << "write " << i << " without a wait for its copy";
    waits = 0;
  }
  EXPECT_GT(last_of(calls, "staged"), last_of(calls, "to_host"));
  EXPECT_GT(last_of(calls, "staged"), last_of(calls, "wait"));
  EXPECT_EQ(device->stats().pinned_allocations, before.pinned_allocations);  // the budget was allocated once
  EXPECT_TRUE(t.saved_in(dir / "a.h5"));
}

// Many ranks, host and device shards (on a device that runs its stream only when waited for), with
// and without check_unchanged: the shards change as soon as wait_staged() returns, and the
// checkpoint holds them as they were. A host saver streams its shards from where they are.
TEST(BoundedAsyncSave, SavesTheWeightsAsTheyWereUntilWaitStaged) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  for (const bool on_device : {false, true})
    for (const bool check : {false, true}) {
      run_ranks(l.ranks(), [&](ProcessGroup& g) {
        const auto device = std::make_shared<EmulatedDevice>(0, EmulatedDevice::Progress::when_waited);
        const demo::ShardMemory where = on_device ? demo::ShardMemory{MemoryKind::device, device} : demo::ShardMemory{};
        demo::RankModel m = demo::build_rank(c, l, g.rank(), {.adam = true}, where);
        Saver saver(g, {.engine = on_device ? device : nullptr, .staging_buffer_bytes = 256, .check_unchanged = check});
        ASSERT_GT(static_cast<std::size_t>(m.shard_bytes), 2 * saver.async_host_bytes());
        const EngineStats before = device->stats();
        AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
        pending.wait_staged();
        for (std::size_t i = 0; i < m.state.params().size(); ++i)
          if (const MutTensorView shard = m.state.mut_shard(i).mut_view(); !shard.empty()) scribble(shard, device.get());
        pending.wait();
        EXPECT_EQ(saver.staging_bytes(), 512u);  // held from the start; host rows stream past it
        EXPECT_EQ(device->stats().pinned_allocations, before.pinned_allocations);
        EXPECT_EQ(device->stats().device_allocations, before.device_allocations);
        EXPECT_EQ(device->stats().unfinished, 0u);
      });
      EXPECT_EQ(host_mismatches(c, {1, 4, 4, 1}, dir / "a.h5", {.adam = true}), 0)
          << (on_device ? "device" : "host") << (check ? ", checked" : "");
    }
}

// A copy that fails on one rank while its bytes stream: every rank's wait_staged() returns, every
// rank's wait() throws that rank's error, the earlier checkpoint stands, and the savers save again.
TEST(BoundedAsyncSave, AFailureWhileStreamingFailsEveryRankAndCommitsNothing) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 0, 1};
  save_layout_of(c, l, dir / "a.h5");
  const std::string earlier = file_bytes(dir / "a.h5");
  std::vector<std::string> messages(2);
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const auto device = std::make_shared<EmulatedDevice>();
    const auto engine = std::make_shared<Recording>(*device, g.rank() == 1 ? 3 : 0);  // rank 1's third copy
    demo::RankModel m = demo::build_rank(c, l, g.rank(), {}, {MemoryKind::device, device});
    Saver saver(g, {.engine = engine, .staging_buffer_bytes = 256});
    AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
    pending.wait_staged();
    const Error e = error_of([&] { pending.wait(); });
    EXPECT_EQ(e.code(), Errc::device) << e.what();
    messages[static_cast<std::size_t>(g.rank())] = e.what();
    g.barrier();
    EXPECT_TRUE(file_bytes(dir / "a.h5") == earlier);
    EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
    EXPECT_EQ(device->stats().unfinished, 0u);
    g.barrier();
    saver.save_async(m.state, dir / "a.h5").wait();
  });
  for (const std::string& m : messages) EXPECT_TRUE(contains(m, "failed a copy on purpose")) << m;
  EXPECT_EQ(host_mismatches(c, {2, 1, 0, 1}, dir / "a.h5"), 0);
}

// Rank 1 changes two rows of a shard after save_async and before the save reads them. With
// check_unchanged every rank's save fails with Errc::shard_changed naming the key and the rows, and
// nothing is committed; without it, the changed rows reach the checkpoint unnoticed.
TEST(BoundedAsyncSave, AShardChangedTooEarlyFailsTheSaveNamingTheKeyAndRows) {
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 0, 1};
  for (const bool on_device : {false, true})
    for (const bool check : {true, false}) {
      ScratchDir dir;
      Gate changed;
      std::vector<std::optional<Errc>> codes(2);
      std::vector<std::string> messages(2);
      TwoRows where;
      run_ranks(l.ranks(), [&](ProcessGroup& g) {
        const auto device = std::make_shared<EmulatedDevice>();
        const demo::ShardMemory memory = on_device ? demo::ShardMemory{MemoryKind::device, device} : demo::ShardMemory{};
        demo::RankModel m = demo::build_rank(c, l, g.rank(), {}, memory);
        Saver saver(g, {.engine = on_device ? device : nullptr, .staging_buffer_bytes = 256, .check_unchanged = check,
                        .save = held_at(&changed, nullptr)});
        AsyncSave pending = saver.save_async(m.state, dir / "a.h5");
        if (g.rank() == 1) {
          where = two_rows_of(m.state.params()[0]);
          scribble(m.state.mut_shard(0).mut_view().slice_rows(where.shard_row, where.shard_row + 2), device.get());
          changed.open();
        }
        try {
          pending.wait();
        } catch (const Error& e) {
          codes[static_cast<std::size_t>(g.rank())] = e.code();
          messages[static_cast<std::size_t>(g.rank())] = e.what();
        }
      });
      const std::string rows = cat("2 of rows [", where.dataset_row, ", ", where.dataset_row + 2, ")");
      for (int r = 0; r < 2 && check; ++r) {
        EXPECT_EQ(codes[static_cast<std::size_t>(r)], Errc::shard_changed) << messages[static_cast<std::size_t>(r)];
        EXPECT_TRUE(contains(messages[static_cast<std::size_t>(r)], cat("key ", where.key, ": ", rows)))
            << messages[static_cast<std::size_t>(r)];
        EXPECT_TRUE(contains(messages[static_cast<std::size_t>(r)], "failed on rank 1"));
        EXPECT_FALSE(std::filesystem::exists(dir / "a.h5"));
      }
      if (!check) EXPECT_GT(mismatches(c, {2, 1, 0, 1}, dir / "a.h5"), 0) << "the changed rows were saved";
    }
}
