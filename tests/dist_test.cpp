// Tests for shardckpt.dist: many thread ranks saving one checkpoint, replicas, validation across
// ranks before any byte is written, and a rank that dies mid-save.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::tiny_model;
using testing_support::file_bytes;
using testing_support::ScratchDir;

namespace {


// Mismatches against the pattern after a load at `l` (each failing the test when `expect_none`).
std::int64_t mismatches_at(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path,
                           bool expect_none = true) {
  std::atomic<std::int64_t> bad{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const demo::Verification v =
        demo::verify(c, {}, g.rank(), demo::request(c, l, g.rank()), load(path, demo::request(c, l, g.rank()), g));
    if (expect_none) EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    bad += v.mismatches;
  });
  return bad.load();
}

// Runs `fn` on `ranks` thread ranks and returns every rank's error code (or nullopt).
template <class Fn>
std::vector<std::optional<Errc>> outcomes(int ranks, Fn&& fn, std::vector<std::string>* messages = nullptr) {
  std::vector<std::optional<Errc>> out(static_cast<std::size_t>(ranks));
  std::mutex m;
  try {
    run_ranks(ranks, [&](ProcessGroup& g) {
      try {
        fn(g);
      } catch (const Error& e) {
        const std::lock_guard lock(m);
        out[static_cast<std::size_t>(g.rank())] = e.code();
        if (messages) messages->push_back(e.what());
        throw;
      }
    });
  } catch (const Error&) {
  }
  return out;
}

// A process group that dies (throws, as a killed process would vanish) at its n-th collective.
struct DyingGroup final : ProcessGroup {
  ProcessGroup& inner;
  int die_at;
  int calls = 0;
  DyingGroup(ProcessGroup& g, int n) : inner(g), die_at(n) {}
  void tick() {
    if (++calls == die_at) throw std::runtime_error("rank killed");
  }
  int rank() const override { return inner.rank(); }
  int size() const override { return inner.size(); }
  void barrier() override { tick(), inner.barrier(); }
  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    tick();
    return inner.split(color, key);
  }
  void all_gather_rows(MutTensorView rows, std::span<const std::int64_t> counts) override {
    tick();
    inner.all_gather_rows(rows, counts);
  }
  std::vector<std::byte> broadcast(std::span<const std::byte> b, int root) override {
    tick();
    return inner.broadcast(b, root);
  }

 protected:
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> b) override {
    tick();
    return all_gather_of(inner, b);
  }
};

// The metadata collectives the library uses, opened for the tests.
struct Probe : ProcessGroup {
  using ProcessGroup::all_gather_of;
  using ProcessGroup::gather_of;
};

}  // namespace

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
      for (ShardedParam& p : m.state.params()) {
        const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
        const Range share = balanced_share(plan.real_rows, p.replicas, p.replica_id);
        const MutTensorView shard = p.shard.mut_view();
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
      for (ShardedParam& p : m.state.params())
        for (bf16& x : p.shard.mut_view().as<bf16>()) x = to_bf16(7.0f);  // a different model
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

namespace {

struct ReplicaLoad {
  std::int64_t values = 0;  // elements compared with the pattern, all ranks
  std::int64_t mismatches = 0;
  std::int64_t bytes_read = 0;  // read from the file, all ranks
  bool padding_only = false;    // some rank of the layout holds a parameter's pad rows only
};

// Loads `path` at `l` on every rank into destinations poisoned with 0xff, the data-parallel copies
// of each shard loading through their replica group (as the tool does), and checks every value.
ReplicaLoad load_through_replicas(const demo::ModelConfig& c, const demo::Layout& l, const demo::Training& t,
                                  const std::filesystem::path& path, bool use_replicas = true) {
  std::atomic<std::int64_t> values{0}, bad{0}, bytes{0};
  std::atomic<bool> padding_only{false};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const demo::RankCoord at = demo::coord_of(l, g.rank());
    const std::unique_ptr<ProcessGroup> replicas = g.split(at.tp * l.gtp + at.gtp, at.dp);
    StateDict dst = demo::with_destinations(demo::request(c, l, g.rank(), t));
    for (const ShardedParam& p : dst.params())
      if (plan_rank(p.spec, p.gtp, p.align, p.coord).padding_only) padding_only = true;
    LoadOptions options;
    options.progress = [&](std::int64_t n) { bytes += n; };
    const Values v = load_into(path, dst, g, options, use_replicas ? replicas.get() : nullptr);
    const demo::Verification check = demo::verify(c, t, g.rank(), dst, v);
    EXPECT_EQ(check.mismatches, 0) << demo::layout_text(l) << ": " << check.first_mismatch;
    values += check.values;
    bad += check.mismatches;
  });
  return {values.load(), bad.load(), bytes.load(), padding_only.load()};
}

void save_layout(const demo::ModelConfig& c, const demo::Layout& l, const demo::Training& t,
                 const std::filesystem::path& path) {
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank(), t);
    save(m.state, path, g);
  });
}

}  // namespace

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
    (void)load_into(dir / "c.h5", dst, LoadOptions{.read_own_share = true});
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

// Thread ranks call HDF5 concurrently: without a thread-safe HDF5 they are refused, one process is not.
TEST(Groups, ThreadRanksNeedAThreadSafeHdf5) {
  EXPECT_TRUE(hdf5_thread_safe());  // Debian's libhdf5 is
  SoloGroup solo;
  EXPECT_NO_THROW(require_thread_safe_hdf5(solo, false));
  run_ranks(2, [&](ProcessGroup& g) {
    EXPECT_NO_THROW(require_thread_safe_hdf5(g, true));
    EXPECT_EQ(testing_support::error_of([&] { require_thread_safe_hdf5(g, false); }).code(), Errc::invalid_argument);
  });
}
