// shardckpt.dist:staging (implementation partition): what an async save does with a rank's bytes
// before they reach the file. A rank whose bytes fit the saver's budget is staged whole, in the
// caller's thread (stage_whole); a larger one streams through the budget in the background, and the
// caller learns when its last byte has left the shards. check_unchanged's hashes (UnchangedCheck)
// prove that no shard changed between save_async and that point. Knows no process group.
module;
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>
module shardckpt.dist:staging;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.merge;
import shardckpt.storage;

namespace shardckpt {

// Pieces staged whole start at multiples of this (any dtype's alignment).
inline constexpr std::size_t whole_alignment = 64;

inline std::size_t aligned_up(std::size_t n) { return (n + whole_alignment - 1) / whole_alignment * whole_alignment; }

// The bytes this rank writes, as they are in its shards.
inline std::size_t written_bytes(const SavePlan& plan) {
  std::size_t n = 0;
  for (const SaveItem& i : plan.items)
    if (i.writes) n += i.data.bytes();
  return n;
}

// The memory stage_whole needs for them: each piece rounded up to whole_alignment.
inline std::size_t whole_staging_bytes(const SavePlan& plan) {
  std::size_t n = 0;
  for (const SaveItem& i : plan.items)
    if (i.writes) n = aligned_up(n) + i.data.bytes();
  return n;
}

// Copies every byte `plan` writes into `memory` (device rows through `engine`, host rows by memcpy)
// and returns once all have landed, with each item's data now its copy; items no rank of this one
// writes lose their data (never read). `memory` holds whole_staging_bytes(plan) at least.
inline SavePlan stage_whole(SavePlan plan, MutTensorView memory, CopyEngine* engine) {
  require(whole_staging_bytes(plan) <= memory.bytes(), Errc::internal, "whole staging past its memory");
  std::size_t at = 0;
  for (SaveItem& i : plan.items) {
    if (!i.writes) {
      i.data = {};
      continue;
    }
    at = aligned_up(at);
    const MutTensorView to =
        MutTensorView::unchecked(memory.data() + at, i.data.dtype(), i.data.shape(), MemorySpace::pinned());
    at += i.data.bytes();
    if (i.data.space().host_accessible()) {
      if (!i.data.empty()) io::copy_guarded(to.data(), i.data.data(), i.data.bytes());  // may be a mapping
    } else {
      require(engine != nullptr && engine->device() == i.data.space(), Errc::invalid_argument, "key ", i.key,
              ": an async save of ", memory_space_text(i.data.space()),
              " memory needs a Saver with that device's CopyEngine");
      engine->copy_to_host(i.data, to);
    }
    i.data = to;
  }
  if (engine) engine->wait(engine->fence());
  return plan;
}

// SaverOptions::check_unchanged: the hash of every row each item writes, taken when save_async is
// called (8 bytes a row), compared with the same rows as they are staged.
class UnchangedCheck {
 public:
  // Hashes host rows where they are and device rows through `pool`'s first buffer, one buffer at a
  // time (the caller waits for every byte to be read once).
  UnchangedCheck(const SavePlan& plan, StagingPool* pool) {
    for (const SaveItem& i : plan.items) {
      Item& out = items_.emplace_back(Item{i.key, i.box.rows.begin, {}});
      if (!i.writes || i.data.empty()) continue;
      out.hashes.reserve(static_cast<std::size_t>(i.data.rows()));
      if (i.data.space().host_accessible()) {
        append_hashes(i.data, out.hashes);
        continue;
      }
      require(pool != nullptr && pool->engine().device() == i.data.space(), Errc::invalid_argument, "key ", i.key,
              ": checking ", memory_space_text(i.data.space()), " memory needs a Saver with that device's CopyEngine");
      const std::int64_t per = pool->rows_per_buffer(i.data);
      for (std::int64_t r0 = 0; r0 < i.data.rows(); r0 += per) {
        const MutTensorView rows = pool->rows_of(0, i.data, std::min(per, i.data.rows() - r0));
        pool->engine().copy_to_host(i.data.slice_rows(r0, r0 + rows.rows()), rows);
        pool->engine().wait(pool->engine().fence());
        append_hashes(rows, out.hashes);
      }
    }
  }

  // Throws Errc::shard_changed, naming the key and the rows of its dataset, unless `rows` (rows
  // [first, first + rows.rows()) of item `item`, as staged) hash as they did.
  void verify(std::size_t item, std::int64_t first, TensorView rows) const {
    require(item < items_.size() && first >= 0 &&
                static_cast<std::size_t>(first + rows.rows()) <= items_[item].hashes.size(),
            Errc::internal, "rows staged past the rows hashed");
    const Item& want = items_[item];
    std::int64_t lo = -1, hi = -1, changed = 0;
    for (std::int64_t r = 0; r < rows.rows(); ++r)
      if (hash_row(rows, r) != want.hashes[static_cast<std::size_t>(first + r)]) {
        if (lo < 0) lo = r;
        hi = r + 1;
        ++changed;
      }
    require(changed == 0, Errc::shard_changed, "key ", want.key, ": ", changed, " of rows [", want.first + first + lo,
            ", ", want.first + first + hi, ") of its dataset changed after save_async and before the save had read "
            "them: a shard must not change until the save's wait_staged() returns (the check_unchanged option)");
  }

  // The same for every item of a plan staged whole.
  void verify_all(const SavePlan& staged) const {
    for (std::size_t n = 0; n < staged.items.size(); ++n)
      if (staged.items[n].writes) verify(n, 0, staged.items[n].data);
  }

 private:
  struct Item {
    std::string key;
    std::int64_t first = 0;  // the dataset row of the item's first row
    std::vector<std::uint64_t> hashes;
  };
  static std::uint64_t hash_row(TensorView rows, std::int64_t r) {
    return XXH3_64bits(rows.data() + static_cast<std::size_t>(r) * rows.row_bytes(), rows.row_bytes());
  }
  static void append_hashes(TensorView rows, std::vector<std::uint64_t>& out) {
    for (std::int64_t r = 0; r < rows.rows(); ++r) out.push_back(hash_row(rows, r));
  }
  std::vector<Item> items_;
};

}  // namespace shardckpt
