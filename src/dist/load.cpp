module;
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.storage;
import shardckpt.state;
import shardckpt.merge;
import shardckpt.merge.seam;
import :wire;
import :protocol;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;

// Opens the checkpoint at `path` on every rank. Rank 0 checks the whole seal of the file's
// metadata; the others then only that their file has the seal rank 0 checked, so that the whole
// metadata is read once, not once per rank. Ranks that are threads of one process share rank 0's
// reader: one open file, one HDF5 file and its caches, one copy of each slab table, for all of them.
std::shared_ptr<const CheckpointReader> open_agreed(const fs::path& path, ProcessGroup& group) {
  std::shared_ptr<const CheckpointReader> reader;
  const bool share = group.threads_of_one_process();
  std::optional<Loan<CheckpointReader>> lent;  // rank 0's, until every rank has taken its share
  const Bytes sealed = decide_at_root(
      group, cat("opening ", path.string()),
      [&] {
        if (group.rank() == 0) reader = std::make_shared<const CheckpointReader>(path);
        return Bytes();
      },
      [&](const std::vector<std::span<const std::byte>>&) {
        Writer w;
        w.i64(static_cast<std::int64_t>(reader->seal().value_or(0)));
        w.i64(share ? static_cast<std::int64_t>(lent.emplace(reader).ticket()) : 0);
        return w.take();
      });
  Reader r(sealed);
  const auto seal = static_cast<std::uint64_t>(r.i64());
  const auto ticket = static_cast<std::uint64_t>(r.i64());
  agree(group, cat("opening ", path.string()), [&] {
    if (group.rank() == 0) return;
    reader = share ? Loan<CheckpointReader>::take(ticket)
                   : std::make_shared<const CheckpointReader>(path, OpenOptions{.trusted_seal = seal});
  });
  return reader;
}

// Whether the data-parallel copies of this rank's shards can share their reads: the group must be
// able to move every destination's memory, on every copy.
bool can_share(ProcessGroup& replicas, const std::vector<ReplicaRows>& rows) {
  const bool mine = std::all_of(rows.begin(), rows.end(), [&](const ReplicaRows& r) { return replicas.moves(r.rows.space()); });
  const Bytes verdict = decide_at_root(
      replicas, "sharing the reads of data-parallel copies", [&] { return Bytes{std::byte{static_cast<unsigned char>(mine)}}; },
      [](const std::vector<std::span<const std::byte>>& all) {
        const bool every = std::all_of(all.begin(), all.end(), [](auto b) { return b.size() == 1 && b[0] == std::byte{1}; });
        return Bytes{std::byte{static_cast<unsigned char>(every)}};
      });
  return verdict.size() == 1 && verdict[0] == std::byte{1};
}

// Every shard with copies must be copy replica_id of `replicas.size()`, and replica_id must be
// this rank's place in the group that hands the rows around.
void check_replicas(const StateDict& state, const ProcessGroup& replicas) {
  const auto check = [&](std::string_view key, int id, int count) {
    require(count == 1 || (count == replicas.size() && id == replicas.rank()), Errc::invalid_argument, "key ", key,
            ": replica ", id, " of ", count, " loads through a replica group in which this rank is ", replicas.rank(),
            " of ", replicas.size());
  };
  for (const ShardedTensor& t : state.tensors()) check(t.key, t.replica_id, t.replicas);
  for (const ShardedParam& p : state.params()) check(p.spec.key, p.replica_id, p.replicas);
}

// What every rank checks before a load reads a byte, in one exchange (each exchange is a round of the
// group, which a small load feels): that no rank refused its input (LoadOptions::refused); that every
// rank opened the same checkpoint, in content as well as in name (each opened it on its own, or was
// given one reader); that every rank's destinations are there, writable and disjoint (ranks that are
// threads of one process also must not share memory with each other: rank 0 checks them all
// together). Returns this rank's rows whose data-parallel copies could share their reads.
std::vector<ReplicaRows> check_before_reading(const CheckpointReader& reader, StateDict& state, ProcessGroup& group,
                                              const LoadOptions& options) {
  const bool across = group.threads_of_one_process() && group.size() > 1;
  const std::uint64_t mine = reader.fingerprint();
  std::vector<ReplicaRows> shared;
  (void)decide_at_root(
      group, cat("loading ", reader.path().string()),
      [&] {
        require(options.refused.empty(), Errc::invalid_argument, options.refused);
        const std::vector<LoadTarget> targets = load_targets(state);
        require_disjoint(targets, cat("rank ", group.rank()));
        shared = replica_rows(state);
        Writer w;
        w.i64(static_cast<std::int64_t>(mine));
        if (!across) return w.take();
        w.i64(static_cast<std::int64_t>(targets.size()));
        for (const LoadTarget& t : targets) {
          w.str(t.key);
          w.u8(static_cast<std::uint8_t>(t.space.kind));
          w.i64(t.space.device);
          w.i64(static_cast<std::int64_t>(t.begin));
          w.i64(static_cast<std::int64_t>(t.end));
        }
        return w.take();
      },
      [&](const std::vector<std::span<const std::byte>>& payloads) {
        std::vector<LoadTarget> all;
        for (std::size_t rank = 0; rank < payloads.size(); ++rank) {
          Reader r(payloads[rank]);
          const auto theirs = static_cast<std::uint64_t>(r.i64());
          require(theirs == mine, Errc::replaced, "rank 0 opened checkpoint ", reader.contents().id, " but rank ", rank,
                  " opened another one (the path was replaced while the ranks opened it, or another tool changed a copy)");
          if (!across) continue;
          for (std::int64_t n = r.i64(); n > 0; --n) {
            LoadTarget t;
            t.key = cat("rank ", rank, "'s ", r.str());
            t.space.kind = static_cast<MemoryKind>(r.u8());
            t.space.device = static_cast<int>(r.i64());
            t.begin = static_cast<std::uintptr_t>(r.i64());
            t.end = static_cast<std::uintptr_t>(r.i64());
            all.push_back(std::move(t));
          }
        }
        if (across) require_disjoint(std::move(all), "thread ranks of one process");
        return Bytes();
      });
  return shared;
}

}  // namespace

Values load_into(const CheckpointReader& reader, StateDict& state, LoadOptions options) {
  require(options.refused.empty(), Errc::invalid_argument, options.refused);
  return load_with(reader, state, options, CheckpointKind::global);
}

Values load_into(const fs::path& path, StateDict& state, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_into(reader, state, std::move(options));
}

LoadedState load(const CheckpointReader& reader, const StateDict& request, LoadOptions options) {
  require(options.refused.empty(), Errc::invalid_argument, options.refused);
  return load_new(reader, request, options);
}

LoadedState load(const fs::path& path, const StateDict& request, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load(reader, request, std::move(options));
}

std::shared_ptr<const CheckpointReader> open_checkpoint(const fs::path& path, ProcessGroup& group) {
  return open_agreed(path, group);
}

Values load_into(const CheckpointReader& reader, StateDict& state, ProcessGroup& group, LoadOptions options,
                 Replicas replicas) {
  require_thread_safe_hdf5(group.threads_of_one_process() && group.size() > 1);
  const std::vector<ReplicaRows> shared = check_before_reading(reader, state, group, options);
  if (group.rank() == 0) notice_unchecked(reader, options);
  const bool share = replicas && replicas.group().size() > 1 && !shared.empty() && can_share(replicas.group(), shared);
  std::optional<Values> out;
  agree(group, cat("loading ", reader.path().string()), [&] {
    if (share) check_replicas(state, replicas.group());
    out.emplace(load_with(reader, state, options, CheckpointKind::global, share));
  });
  // Each copy read its share of every shard's rows: now they hand them to each other.
  if (share)
    for (const ReplicaRows& r : shared) replicas.group().all_gather_rows(r.rows, r.counts);
  return std::move(*out);
}

Values load_into(const fs::path& path, StateDict& state, ProcessGroup& group, LoadOptions options,
                 Replicas replicas) {
  const std::shared_ptr<const CheckpointReader> reader = open_agreed(path, group);
  return load_into(*reader, state, group, std::move(options), replicas);
}

// Each rank maps what it can of its own request (entries whose rows no replicas share: those are read
// in shares); a rank that fails to (a checksum mismatch) fails the load on every rank.
LoadedState load(const CheckpointReader& reader, const StateDict& request, ProcessGroup& group, LoadOptions options,
                 Replicas replicas) {
  std::optional<Allocated> a;
  agree(group, cat("loading ", reader.path().string()), [&] {
    require(options.refused.empty(), Errc::invalid_argument, options.refused);
    a.emplace(map_or_allocate(reader, request, options, false));
  });
  Values values = load_into(reader, a->state, group, std::move(options), replicas);
  return LoadedState(std::move(a->buffers), std::move(values));
}

LoadedState load(const fs::path& path, const StateDict& request, ProcessGroup& group, LoadOptions options,
                 Replicas replicas) {
  const std::shared_ptr<const CheckpointReader> reader = open_agreed(path, group);
  return load(*reader, request, group, std::move(options), replicas);
}

}  // namespace shardckpt
