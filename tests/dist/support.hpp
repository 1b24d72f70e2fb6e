// Helpers shared by the dist suites (tests/dist/*_test.cpp), the tests for shardckpt.dist: many
// thread ranks saving one checkpoint, replicas, validation across ranks before any byte is written,
// and a rank that dies mid-save.
#pragma once
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
inline std::int64_t mismatches_at(const demo::ModelConfig& c, const demo::Layout& l,
                                  const std::filesystem::path& path, bool expect_none = true) {
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

struct ReplicaLoad {
  std::int64_t values = 0;  // elements compared with the pattern, all ranks
  std::int64_t mismatches = 0;
  std::int64_t bytes_read = 0;  // read from the file, all ranks
  bool padding_only = false;    // some rank of the layout holds a parameter's pad rows only
};

// Loads `path` at `l` on every rank into destinations poisoned with 0xff, the data-parallel copies
// of each shard loading through their replica group (as the tool does), and checks every value.
inline ReplicaLoad load_through_replicas(const demo::ModelConfig& c, const demo::Layout& l, const demo::Training& t,
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
    const Values v = load_into(path, dst, g, options, use_replicas ? Replicas(*replicas) : Replicas());
    const demo::Verification check = demo::verify(c, t, g.rank(), dst, v);
    EXPECT_EQ(check.mismatches, 0) << demo::layout_text(l) << ": " << check.first_mismatch;
    values += check.values;
    bad += check.mismatches;
  });
  return {values.load(), bad.load(), bytes.load(), padding_only.load()};
}

inline void save_layout(const demo::ModelConfig& c, const demo::Layout& l, const demo::Training& t,
                        const std::filesystem::path& path) {
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank(), t);
    save(m.state, path, g);
  });
}

}  // namespace
