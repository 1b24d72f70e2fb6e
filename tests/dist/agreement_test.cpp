// What a save promises whatever its caller and its process group do: a row another thread changes
// while it is written fails the save, and no checksum lies about the file; ranks that name different paths all
// fail; a group that delivers other bytes than were sent commits nothing; a peer that fails after
// the commit leaves a complete checkpoint and an error that says so; a flat range that holds
// nothing of its parameter is a tiling error, not a missing key; names HDF5 would cut are refused;
// a failure of many ranks is said once.
#include "support.hpp"

namespace {

// `b`, which another thread writes all along while `fn` runs: `fn` starts once that thread has
// gone over `b` once. Whether it runs while the rows are written is the scheduler's say: on this
// project's 2-core machine about 3 saves in 10 saw no change (the writer thread, busy all along,
// yields its core to the kernel's writeback), so the tests repeat until one does.
template <class Fn>
void while_changing(SharedBuffer& b, Fn&& fn) {
  std::atomic<bool> stop{false}, started{false};
  std::thread writer([&] {
    float* p = b.mut_view().as<float>().data();
    const auto n = static_cast<std::size_t>(b.shape().elements());
    for (float step = 1; !stop.load(std::memory_order_relaxed); ++step) {
      for (std::size_t i = 0; i < n; i += 97) reinterpret_cast<volatile float*>(p)[i] = step;
      started.store(true, std::memory_order_release);
    }
  });
  while (!started.load(std::memory_order_acquire)) std::this_thread::yield();
  try {
    fn();
  } catch (...) {
    stop = true;
    writer.join();
    throw;
  }
  stop = true;
  writer.join();
}

// Another thread writes the shard while it is saved (a data race of the caller's, which the library
// must not turn into a file whose checksums lie): each row is hashed before and after its write, so
// the save fails with Errc::shard_changed naming the key and the row and commits nothing, or commits
// a file whose checksums describe its bytes. A checksum taken once, of bytes read again for the
// write, gives committed files that fail verification; a copy the checksums describe commits torn
// tensors without a word.
TEST(Checksums, ARowChangedWhileItIsWrittenFailsTheSaveAndNothingLies) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  for (const IoMethod method : {IoMethod::raw, IoMethod::hyperslab}) {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {4096, 512});  // 8 MiB: the writer changes it all along
    StateDict s;
    s.add(ShardedTensor::of("w", b, {4096, 512}, {0, 0}));
    SaveOptions o;
    o.method = method;
    save(s, path, o);  // the earlier checkpoint, before any change
    int refused = 0;
    for (int round = 0; round < 3 || (refused == 0 && round < 40); ++round) {
      const std::string before = CheckpointReader(path).contents().id;
      try {
        while_changing(b, [&] { save(s, path, o); });
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::shard_changed) << e.what();
        EXPECT_NE(std::string(e.what()).find("key w: row "), std::string::npos) << e.what();
        EXPECT_EQ(CheckpointReader(path).contents().id, before) << "a failed save replaced the checkpoint";
        ++refused;
      }
      const VerifyReport v = verify_checkpoint(CheckpointReader(path));
      EXPECT_EQ(v.mismatches, 0) << "round " << round;
      EXPECT_EQ(v.checksum_rows, 4096) << "round " << round;
      EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
    }
    EXPECT_GT(refused, 0) << "no save saw a row change under it";
  }
}

// A rank whose write fails (here: its shard changes under the write) fails every rank in the commit's
// first exchange, where the raw path's write step runs: nothing is sealed, the earlier checkpoint
// stays as it was, no temporary file is left, and every rank names the failing rank, key and row.
TEST(Checksums, ARankWhoseWriteFailsFailsEveryRankAndCommitsNothing) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  constexpr int ranks = 3;
  const auto save_rows = [&](ProcessGroup& g, SharedBuffer& b) {
    StateDict s;
    s.add(ShardedTensor::of("w", b, {ranks * 1024, 512}, {g.rank() * 1024, 0}));
    save(s, path, g);
  };
  run_ranks(ranks, [&](ProcessGroup& g) {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {1024, 512});
    save_rows(g, b);
  });
  int refused = 0;
  for (int round = 0; refused == 0 && round < 40; ++round) {
    const std::string earlier = file_bytes(path);
    std::vector<std::string> messages;
    const auto codes = outcomes(
        ranks,
        [&](ProcessGroup& g) {
          SharedBuffer b = SharedBuffer::zeros(DType::f32, {1024, 512});  // 2 MiB a rank
          if (g.rank() == 2)
            while_changing(b, [&] { save_rows(g, b); });
          else
            save_rows(g, b);
        },
        &messages);
    // Every rank committed: no row changed under rank 2's write this time.
    if (std::none_of(codes.begin(), codes.end(), [](const auto& c) { return c.has_value(); })) continue;
    for (const auto& code : codes) EXPECT_EQ(code, Errc::shard_changed) << "round " << round;
    ASSERT_EQ(messages.size(), static_cast<std::size_t>(ranks));
    for (const std::string& m : messages) {
      EXPECT_NE(m.find("failed on rank 2"), std::string::npos) << m;
      EXPECT_NE(m.find("key w: row "), std::string::npos) << m;
    }
    EXPECT_TRUE(file_bytes(path) == earlier) << "round " << round << ": a failed save changed the checkpoint";
    EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty()) << "round " << round;
    ++refused;
  }
  EXPECT_GT(refused, 0) << "no save saw a row change under it";
  EXPECT_EQ(verify_checkpoint(CheckpointReader(path)).mismatches, 0);
}

TEST(Paths, RanksThatNameDifferentPathsAllFailAndWriteNothing) {
  ScratchDir dir;
  std::vector<std::string> messages;
  const auto codes = outcomes(
      3,
      [&](ProcessGroup& g) {
        SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
        StateDict s;
        s.add(ShardedTensor::of("t", b, {6, 2}, {g.rank() * 2, 0}));
        save(s, dir / (g.rank() == 2 ? "other.h5" : "c.h5"), g);
      },
      &messages);
  for (const auto& code : codes) EXPECT_EQ(code, Errc::invalid_argument);
  ASSERT_FALSE(messages.empty());
  EXPECT_NE(messages.front().find("rank 2 to '"), std::string::npos) << messages.front();
  EXPECT_FALSE(std::filesystem::exists(dir / "c.h5"));
  EXPECT_FALSE(std::filesystem::exists(dir / "other.h5"));
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
  // The same path spelled another way is the same path.
  run_ranks(2, [&](ProcessGroup& g) {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
    StateDict s;
    s.add(ShardedTensor::of("t", b, {4, 2}, {g.rank() * 2, 0}));
    save(s, g.rank() == 0 ? dir / "c.h5" : dir / "." / "c.h5", g);
  });
  EXPECT_EQ(verify_checkpoint(CheckpointReader(dir / "c.h5")).mismatches, 0);
  // One rank names it relative to the working directory, one absolutely, one through a linked
  // directory: what the names resolve to is compared, not their text.
  std::filesystem::create_directory_symlink(dir.path(), dir / "via");
  const std::filesystem::path before = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  run_ranks(3, [&](ProcessGroup& g) {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
    StateDict s;
    s.add(ShardedTensor::of("t", b, {6, 2}, {g.rank() * 2, 0}));
    const std::filesystem::path names[] = {"d.h5", dir / "d.h5", dir / "via" / "d.h5"};
    save(s, names[g.rank()], g);
  });
  std::filesystem::current_path(before);
  EXPECT_EQ(verify_checkpoint(CheckpointReader(dir / "d.h5")).mismatches, 0);
}

// A group that hands rank `victim` other bytes than were broadcast at its `nth` broadcast: the last
// 8 bytes (in the planning verdict, the victim's first row in the checksum table) set to `value`.
struct GarblingGroup final : ProcessGroup {
  ProcessGroup& inner;
  int victim, nth, calls = 0;
  std::int64_t value;
  GarblingGroup(ProcessGroup& g, int victim, int nth, std::int64_t value)
      : inner(g), victim(victim), nth(nth), value(value) {}
  int rank() const override { return inner.rank(); }
  int size() const override { return inner.size(); }
  void barrier() override { inner.barrier(); }
  std::unique_ptr<ProcessGroup> split(int color, int key) override { return inner.split(color, key); }
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override {
    inner.all_gather_rows(rows, counts);
  }
  std::vector<std::byte> broadcast(std::span<const std::byte> b, int root) override {
    std::vector<std::byte> out = inner.broadcast(b, root);
    if (rank() == victim && ++calls == nth && out.size() >= 8) std::memcpy(out.data() + out.size() - 8, &value, 8);
    return out;
  }

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> b) override { return all_gather_of(inner, b); }
  std::vector<std::vector<std::byte>> gather(std::span<const std::byte> b, int root) override {
    return gather_of(inner, b, root);
  }
};

TEST(Groups, AGroupThatGarblesThePlanningVerdictCommitsNothing) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  const auto path = dir / "c.h5";
  save_layout(c, l, {}, path);
  const std::string earlier = file_bytes(path);
  // Rank 3 is told that its checksums start where rank 0's do: it would overwrite them.
  const auto codes = outcomes(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    for (std::size_t i = 0; i < m.state.params().size(); ++i)
      for (bf16& x : m.state.mut_shard(i).mut_view().as<bf16>()) x = to_bf16(7.0f);
    GarblingGroup garbling(g, 3, 1, 0);
    save(m.state, path, garbling);
  });
  for (const auto& code : codes) EXPECT_EQ(code, Errc::collective);
  EXPECT_TRUE(file_bytes(path) == earlier);
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
}

// Counts a rank's collectives (a DyingGroup that never dies).
int collectives_of_a_save(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path) {
  std::atomic<int> calls{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    DyingGroup counting(g, -1);
    save(m.state, path, counting);
    if (g.rank() == 2) calls = counting.calls;
  });
  return calls.load();
}

TEST(Groups, APeerThatFailsAfterTheCommitLeavesACompleteCheckpointAndSaysSo) {
  ScratchDir dir;
  const auto c = tiny_model();
  const demo::Layout l{2, 2, 8, 1};
  const auto path = dir / "c.h5";
  const int last = collectives_of_a_save(c, l, path);
  ASSERT_GT(last, 3);
  std::vector<std::string> messages;
  std::mutex m;
  const auto codes = outcomes(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel model = demo::build_rank(c, l, g.rank());
    DyingGroup dying(g, g.rank() == 2 ? last : -1);
    try {
      save(model.state, path, dying);
    } catch (const Error& e) {
      const std::lock_guard lock(m);
      if (g.rank() == 0 || g.rank() == 1) messages.push_back(cat(g.rank(), ": ", e.what()));
      throw;
    }
  });
  EXPECT_EQ(codes[0], Errc::committed_peer_failed);
  EXPECT_EQ(codes[1], Errc::collective);
  for (const std::string& text : messages)
    EXPECT_TRUE(text.find(text[0] == '0' ? "is committed and complete" : "unknown to rank 1") != std::string::npos)
        << text;
  // The checkpoint is there, complete, and holds what was saved.
  EXPECT_EQ(verify_checkpoint(CheckpointReader(path)).mismatches, 0);
  EXPECT_EQ(mismatches_at(c, {1, 4, 8, 1}, path), 0);
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());
}

// A failure of many ranks is said once in the message every rank gets: ranks with the same message
// are named together as runs ("ranks 0-3, 6"), and ranks whose messages differ only in their own
// numbers (their GTP rank) are said in the lowest one's words.
TEST(Messages, EachFailureIsSaidOnce) {
  ScratchDir dir;
  std::vector<std::string> messages;
  (void)outcomes(
      8,
      [&](ProcessGroup& g) {
        StateDict s;
        if (g.rank() < 4 || g.rank() == 6)
          s.add(ShardedTensor::expect("t", DType::f32, {2, 2}, {16, 2}, {g.rank() * 2, 0}));
        else
          s.add(ShardedTensor::of("t", SharedBuffer::zeros(DType::f32, {2, 2}), {16, 2}, {g.rank() * 2, 0}));
        save(s, dir / "c.h5", g);
      },
      &messages);
  ASSERT_EQ(messages.size(), 8u);
  for (const std::string& m : messages) {
    EXPECT_EQ(m, messages.front());
    EXPECT_NE(m.find("failed on ranks 0-3, 6: tensor t: no data to save"), std::string::npos) << m;
    EXPECT_EQ(m.find("; and on"), std::string::npos) << m;
  }
  messages.clear();
  (void)outcomes(
      8,
      [&](ProcessGroup& g) {
        ShardedParam p;
        p.spec.key = "w";
        p.spec.sections = plain_sections(16);
        p.spec.trailing = {4};
        p.gtp = 8;
        p.coord = {0, g.rank()};
        StateDict s;
        s.add(p);  // no shard: each rank's message names its own GTP rank
        save(s, dir / "c.h5", g);
      },
      &messages);
  ASSERT_EQ(messages.size(), 8u);
  for (const std::string& m : messages) {
    EXPECT_EQ(m, messages.front());
    EXPECT_NE(m.find("failed on ranks 0-7: parameter w (TP rank 0, GTP rank 0): no shard to save (in rank 0's words; "
                     "ranks 1-7 said the same of their own numbers)"),
              std::string::npos)
        << m;
    EXPECT_EQ(m.find("GTP rank 1"), std::string::npos) << m;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "c.h5"));
}

TEST(Tiling, AnEmptyFlatRangeOfTheOnlyHolderIsATilingError) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  for (const Range flat : {Range{3, 3}, Range{0, 0}, Range{0, 16}}) {
    ShardedParam p;
    p.spec.key = "w";
    p.spec.sections = {{"a", 4}, {"b", 4}};
    p.spec.trailing = {4};
    p.flat = flat;
    p.shard = SharedBuffer::zeros(DType::f32, p.shard_shape());
    StateDict s;
    s.add(p);
    try {
      save(s, path);
      ADD_FAILURE() << "a save of the flat range [" << flat.begin << ", " << flat.end << ") of 32 elements committed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::tiling) << e.what();
      EXPECT_NE(std::string(e.what()).find(flat.begin == 0 && flat.end == 16 ? "w.b" : "w.a"), std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(path));
  }
}

TEST(Names, NulBytesAndOverlongNamesAreRefusedBeforeAnythingIsWritten) {
  using namespace std::string_literals;
  SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
  const auto refused = [&](auto&& add, std::string_view needle) {
    StateDict s;
    try {
      add(s);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused([&](StateDict& s) { s.add(ShardedTensor::of("t\0u"s, b, {2, 2}, {0, 0})); }, "NUL byte at byte 1");
  refused([&](StateDict& s) { s.add_common("k\0z"s, std::int64_t{1}); }, "NUL byte at byte 1");
  refused([&](StateDict& s) { s.add_common("k", "a\0b"s); }, "NUL byte at byte 1");
  refused([&](StateDict& s) { s.add_local("k\0z"s, std::int64_t{1}); }, "NUL byte");
  refused([&](StateDict& s) { s.add(ShardedTensor::of(std::string(5000, 'k'), b, {2, 2}, {0, 0})); },
          "longer than 4096 bytes");
  ShardedParam p;
  p.spec.key = "w";
  p.spec.sections = {{"a\0b"s, 2}, {"c", 2}};
  p.spec.trailing = {2};
  p.shard = b;
  refused([&](StateDict& s) { s.add(p); }, "a section name");
  p.spec.sections[0].name = "a";
  refused([&](StateDict& s) { s.add(optimizer_state(p, "exp\0avg"s, DType::f32)); }, "an optimizer state's name");
  // A long name within the limit round-trips.
  ScratchDir dir;
  const std::string key(4000, 'k');
  StateDict s;
  s.add(ShardedTensor::of(key, b, {2, 2}, {0, 0}));
  s.add_common(std::string(4000, 'c'), std::string(100000, 'v'));
  save(s, dir / "c.h5");
  const CheckpointReader reader(dir / "c.h5");
  EXPECT_EQ(std::get<std::string>(reader.contents().common.at(std::string(4000, 'c'))), std::string(100000, 'v'));
  EXPECT_EQ(verify_checkpoint(reader).datasets, 1);
}

}  // namespace

namespace {

SharedBuffer filled(float value) {
  SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
  for (float& v : b.mut_view().as<float>()) v = value;
  return b;
}

StateDict rows_of_rank(SharedBuffer& b, int rank, int ranks) {
  StateDict s;
  s.add(ShardedTensor::of("t", b, {2 * ranks, 2}, {2 * rank, 0}));
  return s;
}

}  // namespace

// A front end that refused its input on one rank (SaveOptions::refused, LoadOptions::refused) fails
// every rank in the call's first exchange: one gather and one broadcast, the reason and the rank
// named on every rank, nothing written or read; and the calls take as few rounds as they need.
TEST(Refusals, OneRankRefusingItsInputFailsEveryRankInTheFirstExchange) {
  ScratchDir dir;
  const auto path = dir / "c.h5";
  std::vector<std::string> messages;
  std::vector<int> calls(3);
  auto codes = outcomes(
      3,
      [&](ProcessGroup& g) {
        SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
        DyingGroup counting(g, -1);
        SaveOptions o;
        if (g.rank() == 1) o.refused = "w: a tensor on the meta device has no bytes to save";
        try {
          save(rows_of_rank(b, g.rank(), 3), path, counting, o);
        } catch (...) {
          calls[static_cast<std::size_t>(g.rank())] = counting.calls;
          throw;
        }
      },
      &messages);
  for (const auto& code : codes) EXPECT_EQ(code, Errc::invalid_argument);
  for (const int c : calls) EXPECT_EQ(c, 2);  // the planning gather and its verdict
  ASSERT_EQ(messages.size(), 3u);
  for (const std::string& m : messages)
    EXPECT_NE(m.find("failed on rank 1: w: a tensor on the meta device"), std::string::npos) << m;
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(testing_support::temporary_files(dir.path()).empty());

  // A save without refusals: planning, then the writes (each rank opening the file as it writes) in the
  // commit's first exchange: two rounds of a gather and a broadcast.
  run_ranks(3, [&](ProcessGroup& g) {
    SharedBuffer b = filled(static_cast<float>(g.rank()));
    DyingGroup counting(g, -1);
    save(rows_of_rank(b, g.rank(), 3), path, counting);
    calls[static_cast<std::size_t>(g.rank())] = counting.calls;
  });
  for (const int c : calls) EXPECT_EQ(c, 4);

  // A load through readers the ranks opened: refused by rank 2 in its first exchange, nothing read.
  messages.clear();
  codes = outcomes(
      3,
      [&](ProcessGroup& g) {
        const std::shared_ptr<const CheckpointReader> reader = open_checkpoint(path, g);
        SharedBuffer b = filled(-1.0f);
        StateDict s = rows_of_rank(b, g.rank(), 3);
        DyingGroup counting(g, -1);
        LoadOptions o;
        if (g.rank() == 2) o.refused = "state_dict['x']: not in the checkpoint";
        try {
          (void)load_into(*reader, s, counting, o);
        } catch (...) {
          calls[static_cast<std::size_t>(g.rank())] = counting.calls;
          EXPECT_EQ(b.view().as<float>()[0], -1.0f);  // nothing read
          throw;
        }
      },
      &messages);
  for (const auto& code : codes) EXPECT_EQ(code, Errc::invalid_argument);
  for (const int c : calls) EXPECT_EQ(c, 2);
  ASSERT_EQ(messages.size(), 3u);
  for (const std::string& m : messages)
    EXPECT_NE(m.find("failed on rank 2: state_dict['x']: not in the checkpoint"), std::string::npos) << m;
  // Without: the checks before reading, then the reads.
  run_ranks(3, [&](ProcessGroup& g) {
    const std::shared_ptr<const CheckpointReader> reader = open_checkpoint(path, g);
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {2, 2});
    StateDict s = rows_of_rank(b, g.rank(), 3);
    DyingGroup counting(g, -1);
    (void)load_into(*reader, s, counting);
    calls[static_cast<std::size_t>(g.rank())] = counting.calls;
    EXPECT_EQ(b.view().as<float>()[3], static_cast<float>(g.rank()));
  });
  for (const int c : calls) EXPECT_EQ(c, 4);
  // One process alone: the refusal is its error.
  SharedBuffer b = SharedBuffer::zeros(DType::f32, {6, 2});
  StateDict s;
  s.add(ShardedTensor::of("t", b, {6, 2}, {0, 0}));
  EXPECT_EQ(testing_support::error_of([&] { (void)load_into(path, s, LoadOptions{.refused = "no"}); }).code(), Errc::invalid_argument);
  EXPECT_EQ(testing_support::error_of([&] { save(s, dir / "d.h5", SaveOptions{.refused = "no"}); }).code(), Errc::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(dir / "d.h5"));
}
