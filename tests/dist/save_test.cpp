// Tests for shardckpt.dist saves: many thread ranks saving one checkpoint, data-parallel replicas
// each writing their share, validation across ranks before any byte is written, and a rank that
// dies or fails mid-save.
#include "support.hpp"

TEST(ThreadRanks, EightRanksSaveOneCheckpointAndLoadAtAnotherLayout) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout save_layout{2, 4, 8, 1};
  ASSERT_EQ(save_layout.ranks(), 8);
  run_ranks(8, [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, save_layout, g.rank());
    save(m.state, dir / "c.h5", g);
  });
  // The row-parallel weight is stored one chunk per TP band: each band's rows are contiguous.
  EXPECT_EQ(testing_support::run_python(R"(
import h5py, sys
f = h5py.File(sys.argv[1], "r")
out = f["decoder.layers.0.mixer.out_proj.weight"]
assert out.chunks == (out.shape[0], out.shape[1] // 2), out.chunks
assert f["decoder.layers.0.mixer.in_proj.weight.z"].chunks is None
)",
                                        (dir / "c.h5").string()),
            0);
  EXPECT_EQ(mismatches_at(c, {4, 1, 0, 1}, dir / "c.h5"), 0);
  EXPECT_EQ(mismatches_at(c, {1, 3, 16, 1}, dir / "c.h5"), 0);
}

TEST(ThreadRanks, HyperslabPathTakesTurnsAndWritesTheSameFile) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 4, 1};
  for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab})
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      demo::RankModel rank = demo::build_rank(c, l, g.rank());
      save(rank.state, dir / (m == IoMethod::raw ? "d.h5" : "h.h5"), g, {m});
    });
  EXPECT_TRUE(testing_support::same_tensors(dir / "d.h5", dir / "h.h5"));
  EXPECT_TRUE(testing_support::same_checksums(dir / "d.h5", dir / "h.h5"));
  EXPECT_EQ(mismatches_at(c, {1, 2, 8, 1}, dir / "h.h5"), 0);
}

// Data-parallel copies of a shard each write a balanced share of its real rows: with every row
// outside a copy's share poisoned the file is still exact, and with a copy's own share poisoned it
// is not (so every copy writes, and only its share).
TEST(ThreadRanks, DataParallelReplicasEachWriteTheirShare) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 3};
  for (const bool poison_own : {false, true}) {
    run_ranks(l.ranks(), [&](ProcessGroup& g) {
      demo::RankModel m = demo::build_rank(c, l, g.rank());
      for (std::size_t i = 0; i < m.state.params().size(); ++i) {
        const ShardedParam& p = m.state.params()[i];
        const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
        const Range share = balanced_share(plan.real_rows, p.replicas, p.replica_id);
        const MutTensorView shard = m.state.mut_shard(i).mut_view();
        for (std::int64_t r = 0; r < plan.real_rows; ++r)
          if ((r >= share.begin && r < share.end) == poison_own)
            for (bf16& x : shard.slice_rows(r, r + 1).as<bf16>()) x = to_bf16(-1.0f);
      }
      save(m.state, dir / "c.h5", g);
    });
    if (poison_own)
      EXPECT_GT(mismatches_at(c, {1, 2, 0, 1}, dir / "c.h5", false), 0);
    else
      EXPECT_EQ(mismatches_at(c, {1, 2, 0, 1}, dir / "c.h5"), 0);
  }
}

TEST(Validation, OverlapGapAndDtypeMismatchStopTheSaveBeforeAnyByteIsWritten) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  run_ranks(2, [&](ProcessGroup& g) {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {4, 2});
    StateDict s;
    s.add(ShardedTensor::of("t", b, {8, 2}, {g.rank() * 4, 0}));
    save(s, path, g);
  });
  const std::string earlier = file_bytes(path);
  struct Case {
    const char* name;
    Errc code;
    std::string needle;
    std::int64_t offset1;
    DType dtype1;
  };
  const std::vector<Case> cases{
      {"overlap", Errc::tiling, "key t: rows [2, 4) are saved by both rank 0 and rank 1", 2, DType::f32},
      {"gap", Errc::tiling, "key t: rows [4, 6) are saved by no rank", 6, DType::f32},
      {"dtype", Errc::dtype_mismatch, "key t: rank 0 saves f32 but rank 1 saves f64", 4, DType::f64},
  };
  for (const Case& k : cases) {
    std::vector<std::string> messages;
    const auto codes = outcomes(
        2,
        [&](ProcessGroup& g) {
          SharedBuffer b =
              SharedBuffer::zeros(g.rank() == 1 ? k.dtype1 : DType::f32, {g.rank() == 1 && k.offset1 == 6 ? 2 : 4, 2});
          StateDict s;
          s.add(ShardedTensor::of("t", b, {8, 2}, {g.rank() == 0 ? 0 : k.offset1, 0}));
          save(s, path, g);
        },
        &messages);
    for (const auto& code : codes) EXPECT_EQ(code, k.code) << k.name;  // every rank, the same outcome
    ASSERT_EQ(messages.size(), 2u) << k.name;
    for (const std::string& m : messages) EXPECT_NE(m.find(k.needle), std::string::npos) << k.name << ": " << m;
    EXPECT_TRUE(file_bytes(path) == earlier) << k.name;
    EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(path).parent_path()).empty()) << k.name;
  }
}

// Rank 0 validates large claim sets part by part; every part is checked, whichever holds the fault.
TEST(Validation, ManyClaimsAreCheckedPartByPart) {
  ScratchDir dir;
  constexpr int tensors = 9000;  // x 2 ranks: more claims than one part holds
  for (const int bad : {-1, 4321}) {
    std::vector<std::string> messages;
    const auto codes = outcomes(
        2,
        [&](ProcessGroup& g) {
          SharedBuffer b = SharedBuffer::zeros(DType::f32, {1, 1});
          StateDict s;
          for (int t = 0; t < tensors; ++t) {
            const std::int64_t row = t == bad ? 0 : g.rank();  // tensor `bad`: both ranks claim row 0
            s.add(ShardedTensor::of("t" + std::to_string(t), b, {2, 1}, {row, 0}));
          }
          save(s, dir / "many.h5", g);
        },
        &messages);
    for (const auto& code : codes) EXPECT_EQ(code, bad < 0 ? std::nullopt : std::optional<Errc>(Errc::tiling));
    if (bad < 0) {
      EXPECT_EQ(CheckpointReader(dir / "many.h5").datasets().size(), static_cast<std::size_t>(tensors));
    } else {
      ASSERT_FALSE(messages.empty());
      EXPECT_NE(messages[0].find("key t4321: rows [0, 1) are saved by both rank 0 and rank 1"), std::string::npos)
          << messages[0];
    }
  }
}

// The writers' boxes must tile every dataset exactly once, flat ranges included: one DP rank's
// range of one optimizer state shifted by one element (a gap, or an overlap) stops the save on every
// rank with Errc::tiling naming the key, before anything is written.
TEST(Validation, AFlatRangeShiftedByOneElementStopsTheSaveOnEveryRank) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Training adam{.adam = true, .distributed = true};
  const demo::Layout l{1, 2, 8, 2};
  const std::string victim = "optimizer.state.exp_avg.decoder.layers.0.mixer.in_proj.weight";
  const int bad_rank = 2;  // DP rank 1, GTP rank 0
  // Rank `bad_rank`'s state with the victim's range starting `shift` elements later (its shard
  // resized to match, so that only the tiling is wrong).
  const auto state_of = [&](int rank, std::int64_t shift, std::string* first_key) {
    demo::RankModel m = demo::build_rank(c, l, rank, adam);
    if (rank != bad_rank || shift == 0) return std::move(m.state);
    StateDict s;
    for (ShardedParam p : m.state.params()) {
      if (p.spec.key == victim) {
        p.flat->begin += shift;
        p.shard = SharedBuffer::zeros(p.dtype, p.shard_shape());
        // The block that holds the first element of the range as it should have been.
        const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
        const std::int64_t row = (p.flat->begin - shift + std::min<std::int64_t>(shift, 0)) / plan.row_elems;
        for (const Piece& piece : plan.pieces)
          if (row >= piece.shard_row && row < piece.shard_row + piece.rows) *first_key = piece.key;
      }
      s.add(std::move(p));
    }
    for (const auto& [key, value] : m.state.common()) s.add_common(key, value);
    for (const auto& [key, value] : m.state.local()) s.add_local(key, value);
    return s;
  };
  const auto path = dir / "c.h5";
  const auto attempt = [&](std::int64_t shift) {
    std::vector<std::string> messages;
    std::string key;
    const auto codes = outcomes(
        l.ranks(), [&](ProcessGroup& g) { save(state_of(g.rank(), shift, &key), path, g); }, &messages);
    ASSERT_FALSE(key.empty());
    for (const auto& code : codes) EXPECT_EQ(code, Errc::tiling) << "shift " << shift;
    ASSERT_EQ(messages.size(), static_cast<std::size_t>(l.ranks()));
    for (const std::string& m : messages)
      EXPECT_NE(m.find("key " + key + ": rows ["), std::string::npos) << "shift " << shift << ": " << m;
    EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(path).parent_path()).empty()) << "shift " << shift;
  };
  for (const std::int64_t shift : {1, -1}) {
    attempt(shift);
    EXPECT_FALSE(std::filesystem::exists(path)) << "shift " << shift;
  }
  save_layout(c, l, adam, path);
  const std::string earlier = file_bytes(path);
  for (const std::int64_t shift : {1, -1}) {
    attempt(shift);
    EXPECT_TRUE(file_bytes(path) == earlier) << "shift " << shift;
  }
}

TEST(Failure, ARankThatDiesMidSaveLeavesTheEarlierCheckpointIntact) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  const auto path = dir / "c.h5";
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    save(m.state, path, g);
  });
  const std::string earlier = file_bytes(path);
  // Rank 2 dies at its 1st collective (sending its plan), its 2nd (rank 0 has created the file) or
  // its 3rd (it has written its pieces; the others wait for its outcome).
  for (int die_at : {1, 2, 3}) {
    const auto codes = outcomes(l.ranks(), [&](ProcessGroup& g) {
      demo::RankModel m = demo::build_rank(c, l, g.rank());
      for (std::size_t i = 0; i < m.state.params().size(); ++i)
        for (bf16& x : m.state.mut_shard(i).mut_view().as<bf16>()) x = to_bf16(7.0f);  // a different model
      DyingGroup dying(g, g.rank() == 2 ? die_at : -1);
      save(m.state, path, dying);
    });
    for (int r = 0; r < l.ranks(); ++r)
      EXPECT_TRUE(codes[static_cast<std::size_t>(r)] || r == 2) << "rank " << r << " die_at " << die_at;
    EXPECT_TRUE(file_bytes(path) == earlier) << die_at;
    EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(path).parent_path()).empty()) << die_at;
  }
  EXPECT_EQ(mismatches_at(c, {1, 4, 8, 1}, path), 0);
}

TEST(Failure, ARankThatFailsToWriteFailsEveryRank) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  std::vector<std::string> messages;
  const auto codes = outcomes(
      3,
      [&](ProcessGroup& g) {
        SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
        StateDict s;
        s.add(ShardedTensor::of("t", b, {6, 2}, {g.rank() * 2, 0}));
        // Rank 1 is handed a key HDF5 cannot create a dataset for.
        if (g.rank() == 1) s.add(ShardedTensor::of("bad/key", b, {2, 2}, {0, 0}));
        save(s, path, g);
      },
      &messages);
  for (const auto& code : codes) EXPECT_EQ(code, Errc::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(testing_support::temporary_files(std::filesystem::path(path).parent_path()).empty());
}
