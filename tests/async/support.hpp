// Helpers of the async-save suites (tests/async/*_test.cpp), the tests of Saver::save_async: gates
// that hold a background save at a phase until the test lets it go, and writes that change a shard
// behind the save's back, in host or device memory.
#pragma once
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
#include "recording_engine.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::contains;
using testing_support::error_of;
using testing_support::file_bytes;
using testing_support::host_mismatches;
using testing_support::CountingShard;
using testing_support::Recording;
using testing_support::ScratchDir;
using testing_support::tiny_model;

namespace {

// A one-way gate: wait() blocks until open() (or fails the test after 20 s, rather than hanging).
class Gate {
 public:
  void open() {
    const std::lock_guard lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    EXPECT_TRUE(changed_.wait_for(lock, std::chrono::seconds(20), [&] { return open_; })) << "a gate never opened";
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = false;
};

// Save options whose on_phase (rank 0, in the background) waits at `planning` and `committing`
// for their gates (either may be null).
inline SaveOptions held_at(Gate* planning, Gate* committing) {
  SaveOptions o;
  o.on_phase = [=](SavePhase p) {
    if (p == SavePhase::planning && planning) planning->wait();
    if (p == SavePhase::committing && committing) committing->wait();
  };
  return o;
}

// Overwrites `rows` with 0x7f bytes: in place on the host, through `device` in device memory.
inline void scribble(MutTensorView rows, CopyEngine* device) {
  if (rows.space().host_accessible()) {
    std::memset(rows.data(), 0x7f, rows.bytes());
    return;
  }
  std::vector<std::byte> bytes(rows.bytes(), std::byte{0x7f});
  device->copy_to_device(TensorView::unchecked(bytes.data(), DType::u8, {static_cast<std::int64_t>(bytes.size())}),
                         rows.reinterpreted_as(DType::u8));
  device->wait(device->fence());
}

// Where one piece of a rank's first parameter lies: two of its rows, in the shard and in the dataset.
struct TwoRows {
  std::string key;
  std::int64_t shard_row = 0, dataset_row = 0;
};
inline TwoRows two_rows_of(const ShardedParam& p) {
  for (const Piece& piece : plan_rank(p.spec, p.gtp, p.align, p.coord).pieces)
    if (piece.rows >= 3) return {piece.key, piece.shard_row + 1, piece.global_offset[0] + 1};
  ADD_FAILURE() << p.spec.key << " has no piece of 3 rows";
  return {};
}

// A plain save of the demo model at `l`.
inline void save_layout_of(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path) {
  run_ranks(l.ranks(), [&](ProcessGroup& g) { save(demo::build_rank(c, l, g.rank()).state, path, g); });
}

// Mismatches against the pattern after a load at `l` (not failing the test: the caller says what it expects).
inline std::int64_t mismatches(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path) {
  std::atomic<std::int64_t> bad{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    StateDict model = demo::with_destinations(demo::request(c, l, g.rank()));
    bad += demo::verify(c, {}, g.rank(), model, load_into(path, model, g)).mismatches;
  });
  return bad.load();
}

}  // namespace
