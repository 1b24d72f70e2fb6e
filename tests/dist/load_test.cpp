// Tests for shardckpt.dist loads: data-parallel degree changes of the distributed optimizer, reads
// shared by the copies of a replica group, and ranks that must load one and the same checkpoint.
#include "support.hpp"

import shardckpt.merge.seam;  // load_with: one copy's share of a split read, as dist's load asks for it

// Megatron's distributed optimizer: bf16 parameters shared by the DP copies, f32 Adam state in each
// DP rank's flat range. DP 1 -> 4, 4 -> 2 and 3 -> 1, each with another TP, GTP and alignment, and
// with a padding-only rank on both sides: every value comes back.
TEST(DistributedOptimizer, DataParallelDegreeChangesWithTpGtpAndAlignment) {
  ScratchDir dir;
  const auto c = tiny_model();
  ASSERT_EQ(c.dtype, DType::bf16);
  const demo::Training adam{.adam = true, .distributed = true};
  struct Case {
    demo::Layout saved, loaded;
  };
  const std::vector<Case> cases{
      {{2, 2, 16, 1}, {1, 4, 8, 4}},  // DP 1 -> 4
      {{1, 4, 8, 4}, {2, 2, 16, 2}},  // DP 4 -> 2
      {{2, 3, 8, 3}, {1, 3, 8, 1}},   // DP 3 -> 1
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(demo::layout_text(k.saved) + " -> " + demo::layout_text(k.loaded));
    const auto path = dir / "c.h5";
    std::atomic<bool> saved_padding_only{false};
    run_ranks(k.saved.ranks(), [&](ProcessGroup& g) {
      demo::RankModel m = demo::build_rank(c, k.saved, g.rank(), adam);
      for (const ShardedParam& p : m.state.params()) {
        if (plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only) saved_padding_only = true;
        EXPECT_EQ(p.dtype, p.spec.key.starts_with(optimizer_state_prefix) ? DType::f32 : DType::bf16);
        EXPECT_EQ(p.flat.has_value(), p.spec.key.starts_with(optimizer_state_prefix)) << p.spec.key;
      }
      save(m.state, path, g);
    });
    EXPECT_TRUE(saved_padding_only.load());
    const ReplicaLoad r = load_through_replicas(c, k.loaded, adam, path);
    EXPECT_TRUE(r.padding_only);
    EXPECT_EQ(r.mismatches, 0);
    EXPECT_GT(r.values, 0);
  }
}

// Data-parallel copies that load through their replica group read each byte once per group: each
// reads its share from the file and receives the rest from the others. With every destination
// poisoned, all values still verify (the shares were exchanged), and the bytes read by all ranks
// are those of one copy.
TEST(ReplicaReads, EachCopyReadsItsShareAndReceivesTheRest) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Training adam{.adam = true};  // Adam state replicated across DP, like the parameters
  save_layout(c, {2, 2, 8, 1}, adam, dir / "c.h5");
  const ReplicaLoad once = load_through_replicas(c, {1, 2, 8, 1}, adam, dir / "c.h5");
  const ReplicaLoad shared = load_through_replicas(c, {1, 2, 8, 2}, adam, dir / "c.h5");
  EXPECT_EQ(shared.mismatches, 0);
  EXPECT_EQ(shared.values, 2 * once.values);
  EXPECT_GT(once.bytes_read, 0);
  EXPECT_EQ(shared.bytes_read, once.bytes_read);
  // Without the group each copy reads everything itself.
  const ReplicaLoad alone = load_through_replicas(c, {1, 2, 8, 2}, adam, dir / "c.h5", false);
  EXPECT_EQ(alone.mismatches, 0);
  EXPECT_EQ(alone.bytes_read, 2 * once.bytes_read);
}

// The reads are really split: a copy that reads only its own share (what each copy does before the
// exchange) fills its share's rows, leaves the other real rows as they were (the 0xff poison) and
// zeroes the pad rows.
TEST(ReplicaReads, ACopyThatReadsItsOwnShareFillsOnlyThoseRows) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{1, 2, 8, 2};
  save_layout(c, {2, 2, 8, 1}, {}, dir / "c.h5");
  std::int64_t untouched_rows = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    StateDict request = demo::request(c, l, r);
    const LoadedState full = load(dir / "c.h5", request);
    StateDict dst = demo::with_destinations(request);
    (void)load_with(CheckpointReader(dir / "c.h5"), dst, {}, CheckpointKind::global, true);  // this copy's share
    for (const ShardedParam& p : dst.params()) {
      SCOPED_TRACE(cat(p.spec.key, " rank ", r));
      const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
      const Range share = balanced_share(plan.real_rows, p.replicas, p.replica_id);
      ASSERT_EQ(p.replicas, 2);
      const TensorView got = p.shard.view(), want = full.tensor(p.spec.key).view();
      for (std::int64_t row = 0; row < got.rows(); ++row) {
        const TensorView mine = got.slice_rows(row, row + 1);
        const std::byte expected_byte = row < plan.real_rows ? std::byte{0xff} : std::byte{0};
        if (row >= share.begin && row < share.end) {
          ASSERT_EQ(std::memcmp(mine.data(), want.slice_rows(row, row + 1).data(), mine.bytes()), 0) << "row " << row;
          continue;
        }
        for (std::size_t b = 0; b < mine.bytes(); ++b) ASSERT_EQ(mine.data()[b], expected_byte) << "row " << row;
        untouched_rows += row < plan.real_rows;
      }
    }
  }
  EXPECT_GT(untouched_rows, 0);
}

// Concurrent jobs: one keeps replacing the checkpoint at a path (atomically, as every save does)
// while four ranks load it over and over. Each load gives every rank the bytes of one and the same
// checkpoint, or fails on every rank with Errc::replaced; never a mix of two files.
TEST(Consistency, ALoadThatOverlapsAReplaceLoadsOneCheckpointOrFailsTyped) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  // A checkpoint whose every element and whose common value `tag` are `tag`.
  const auto save_tagged = [&](std::int64_t tag, const std::filesystem::path& file) {
    SharedBuffer b = SharedBuffer::zeros(DType::i64, {256, 64});
    for (std::int64_t& x : b.mut_view().as<std::int64_t>()) x = tag;
    StateDict s;
    s.add(ShardedTensor::of("t", b, {256, 64}, {0, 0}));
    s.add_common("tag", tag);
    save(s, file);
  };
  save_tagged(0, path);
  std::atomic<bool> stop{false};
  std::thread replacer([&] {
    for (std::int64_t tag = 1; !stop; ++tag) save_tagged(tag, path);
  });
  int consistent = 0, replaced = 0;
  for (int round = 0; round < 300; ++round) {
    std::vector<std::int64_t> tags(4, -1);
    std::atomic<int> refused{0};
    try {
      run_ranks(4, [&](ProcessGroup& g) {
        StateDict request;
        request.add(ShardedTensor::expect("t", DType::i64, {64, 64}, {256, 64}, {64 * g.rank(), 0}));
        try {
          const LoadedState s = load(path, request, g);
          const std::int64_t tag = std::get<std::int64_t>(s.value("tag"));
          for (std::int64_t x : s.tensor("t").view().as<std::int64_t>()) ASSERT_EQ(x, tag) << "rank " << g.rank();
          tags[static_cast<std::size_t>(g.rank())] = tag;
        } catch (const Error& e) {
          ASSERT_EQ(e.code(), Errc::replaced) << e.what();
          ++refused;
        }
      });
    } catch (const Error& e) {
      ADD_FAILURE() << e.what();
    }
    if (refused == 4) {
      ++replaced;
      continue;
    }
    ASSERT_EQ(refused, 0) << "ranks disagreed on the outcome";
    for (std::int64_t t : tags) ASSERT_EQ(t, tags[0]) << "ranks loaded different checkpoints";
    ++consistent;
  }
  stop = true;
  replacer.join();
  EXPECT_GT(consistent, 0);
  std::printf("%d consistent loads, %d refused as replaced\n", consistent, replaced);
}

// Ranks that load through readers they opened themselves must hold the same checkpoint, in content
// as well as in id: a copy that shares the id (another tool's, without the seal) is refused on every
// rank, never read beside the original.
TEST(Consistency, RanksWhoseReadersHoldDifferentFilesWithOneIdAreRefused) {
  ScratchDir dir;
  SharedBuffer b = SharedBuffer::zeros(DType::i64, {8, 4});
  StateDict s;
  s.add(ShardedTensor::of("t", b, {8, 4}, {0, 0}));
  save(s, dir / "a.h5");
  std::filesystem::copy_file(dir / "a.h5", dir / "copy.h5");
  // The same bytes without the seal's trailer: what a copy by another tool looks like to a reader.
  const CheckpointReader a(dir / "a.h5");
  const std::uint64_t sealed = a.seal().has_value() ? std::filesystem::file_size(dir / "a.h5") : 0;
  ASSERT_GT(sealed, 0u);
  std::filesystem::resize_file(dir / "copy.h5", sealed - 48);
  const CheckpointReader copy(dir / "copy.h5");
  ASSERT_EQ(copy.contents().id, a.contents().id);
  ASSERT_NE(copy.fingerprint(), a.fingerprint());
  std::vector<Errc> codes(2, Errc::internal);
  try {
    run_ranks(2, [&](ProcessGroup& g) {
      StateDict request;
      request.add(ShardedTensor::expect("t", DType::i64, {4, 4}, {8, 4}, {4 * g.rank(), 0}));
      try {
        (void)load(g.rank() == 0 ? a : copy, request, g);
      } catch (const Error& e) {
        codes[static_cast<std::size_t>(g.rank())] = e.code();
      }
    });
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_EQ(codes, std::vector<Errc>(2, Errc::replaced));
  // Both ranks through one reader: loads.
  run_ranks(2, [&](ProcessGroup& g) {
    StateDict request;
    request.add(ShardedTensor::expect("t", DType::i64, {4, 4}, {8, 4}, {4 * g.rank(), 0}));
    EXPECT_NO_THROW((void)load(a, request, g));
  });
}

// Thread ranks that load into the same memory would fill it with each other's rows: refused on every
// rank before anything is read.
TEST(Consistency, ThreadRanksThatShareDestinationMemoryAreRefused) {
  ScratchDir dir;
  {
    SharedBuffer b = SharedBuffer::zeros(DType::i64, {8, 4});
    StateDict s;
    s.add(ShardedTensor::of("t", b, {8, 4}, {0, 0}));
    save(s, dir / "a.h5");
  }
  std::vector<std::int64_t> memory(16, -1);
  std::vector<Errc> codes(2, Errc::internal);
  try {
    run_ranks(2, [&](ProcessGroup& g) {
      StateDict request;  // both ranks' rows land in the same memory
      request.add(ShardedTensor::of("t", unchecked_borrow(MutTensorView::unchecked(memory.data(), DType::i64, {4, 4})),
                                    {8, 4}, {4 * g.rank(), 0}));
      try {
        (void)load_into(dir / "a.h5", request, g);
      } catch (const Error& e) {
        codes[static_cast<std::size_t>(g.rank())] = e.code();
        EXPECT_TRUE(testing_support::contains(e.what(), "thread ranks of one process")) << e.what();
      }
    });
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  EXPECT_EQ(codes, std::vector<Errc>(2, Errc::invalid_argument));
  EXPECT_EQ(memory, std::vector<std::int64_t>(16, -1));
}
