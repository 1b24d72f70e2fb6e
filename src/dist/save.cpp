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

// The datasets whose first element this rank writes: the one rank that sends a parameter's record
// is the one that writes the first element of its first block.
std::set<std::string_view> first_elements(const SavePlan& plan) {
  std::set<std::string_view> out;
  for (const SaveItem& i : plan.items)
    if (i.writes && !i.box.empty() && i.box.rows.begin == 0 && i.box.cols.begin == 0) out.insert(i.key);
  return out;
}

// Checksummed rows of a claim: writers checksum every row of their box.
std::int64_t claim_checksums(const Claim& c) { return c.writes ? checksum_rows_of(c.box) : 0; }
// Claims rank 0 turns into Claim values at a time. Claims of one key always fall into the same part,
// so checking the parts one by one checks everything, while the memory for Claim values stays near
// this many whatever the number of ranks and pieces (the seed's 159k claims would take 42 MiB).
constexpr std::int64_t claims_per_part = 16 * 1024;

// What rank 0 decides in planning: the datasets to create, and where each rank's checksums start.
struct Planned {
  std::vector<Dataset> specs;
  std::vector<std::int64_t> first_checksums;  // per rank
  std::int64_t checksum_rows = 0;
  bool one_machine = true;  // every rank runs on rank 0's machine (io::this_machine), one page cache
};

// Rank 0's side of planning: validates the claims of all ranks, part by part, lays out the checksum
// table (each rank's checksums follow the previous rank's, in the order of its claims), and collects
// the parameter records and rank 0's common values.
Planned validate_in_parts(const std::vector<std::span<const std::byte>>& payloads, CheckpointContents& contents) {
  Planned out;
  std::int64_t claims_total = 0;
  std::string first_path;
  for (std::size_t rank = 0; rank < payloads.size(); ++rank) {
    Reader r(payloads[rank]);
    // Every rank names the same file, or none of them saves: rank 0's path alone would be written.
    std::string path = r.str();
    if (rank == 0) first_path = std::move(path);
    require(rank == 0 || path == first_path, Errc::invalid_argument, "the ranks name different paths: rank 0 saves to '",
            first_path, "', rank ", rank, " to '", path, "'");
    const auto machine = static_cast<std::uint64_t>(r.i64());
    out.one_machine = out.one_machine && machine != 0 && machine == io::this_machine();
    out.first_checksums.push_back(out.checksum_rows);
    out.checksum_rows = checked_add(out.checksum_rows, r.i64(), "checksummed rows of all ranks");
    claims_total = checked_add(claims_total, r.i64(), "claims of all ranks");
  }
  const auto parts =
      static_cast<std::size_t>(std::max<std::int64_t>(1, (claims_total + claims_per_part - 1) / claims_per_part));
  std::map<std::string, ParamRecord, std::less<>> records;
  for (std::size_t part = 0; part < parts; ++part) {
    std::vector<Claim> claims;
    std::vector<std::int64_t> firsts;
    for (std::size_t rank = 0; rank < payloads.size(); ++rank) {
      Reader r(payloads[rank]);
      (void)r.str();  // the path, compared above
      (void)r.i64();  // the machine, compared above
      const std::int64_t checksum_rows = r.i64();
      std::int64_t running = 0;
      for (std::int64_t n = r.i64(); n > 0; --n) {
        Claim c = get_claim(r, static_cast<int>(rank));
        const std::int64_t u = claim_checksums(c);
        if (std::hash<std::string>{}(c.key) % parts == part) {
          firsts.push_back(out.first_checksums[rank] + running);
          claims.push_back(std::move(c));
        }
        running = checked_add(running, u, "checksummed rows of a rank");
      }
      require(running == checksum_rows, Errc::internal, "rank ", rank, " announced ", checksum_rows, " checksummed rows but claims ",
              running);
      if (part > 0) continue;
      for (std::int64_t n = r.i64(); n > 0; --n) {
        ParamRecord rec = get_record(r);
        records.emplace(rec.key, std::move(rec));
      }
      auto common = get_common(r);
      if (rank == 0) contents.common = std::move(common);
    }
    validate_claims(claims);
    for (Dataset& d : datasets_of(claims, firsts)) out.specs.push_back(std::move(d));
  }
  for (auto& [key, rec] : records) contents.params.push_back(std::move(rec));
  std::sort(out.specs.begin(), out.specs.end(),
            [](const Dataset& a, const Dataset& b) { return a.key < b.key; });
  return out;
}


// The file `path` names, as rank 0 compares it with the others': made absolute against this rank's
// working directory, its directory's symbolic links resolved, "." and ".." folded, so that one rank's
// "ckpt/m.h5" and another's "/work/ckpt/m.h5" (or a path through a linked directory) are the same
// file. The name itself is kept (a link there is the save's business, followed or refused).
std::string file_named(const fs::path& path) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);
  if (ec) return path.lexically_normal().string();
  const fs::path dir = fs::weakly_canonical(absolute.parent_path(), ec);
  if (ec) return absolute.lexically_normal().string();
  return (dir / absolute.filename()).lexically_normal().string();
}

// What a rank sends rank 0 in planning: the file it names (file_named), its number of checksummed rows, its claims, the parameter
// records whose first element it writes, and (rank 0) the common values.
Bytes planning_payload(const SavePlan& plan, const fs::path& path, int me) {
  const std::vector<Claim> claims = claims_of(plan, me);
  std::int64_t checksum_rows = 0;
  for (const Claim& c : claims) checksum_rows = checked_add(checksum_rows, claim_checksums(c), "checksummed rows");
  Writer w;
  w.str(file_named(path));
  w.i64(static_cast<std::int64_t>(io::this_machine()));
  w.i64(checksum_rows);
  w.i64(static_cast<std::int64_t>(claims.size()));
  for (const Claim& c : claims) put_claim(w, c);
  const std::set<std::string_view> firsts = first_elements(plan);
  std::vector<const ParamRecord*> owned;
  for (const ParamRecord& r : plan.params)
    if (firsts.contains(block_key(r.key, r.blocks.front().name))) owned.push_back(&r);
  w.i64(static_cast<std::int64_t>(owned.size()));
  for (const ParamRecord* r : owned) put_record(w, *r);
  put_common(w, me == 0 ? plan.common : decltype(plan.common){});
  return w.take();
}

// The file a save writes, as each rank holds it (io::Destination is the path it will replace).
// Rank 0 creates the checkpoint in a temporary file (and later seals and commits it); every rank
// learns its directory, its name and its identity, opens it and checks that it opened that very file.
struct SaveTarget {
  std::optional<CheckpointWriter> checkpoint;  // rank 0
  std::optional<PiecesWritten> mine;           // rank 0: its own pieces, written
  std::optional<io::File> opened;              // the other ranks
  fs::path dir;
  std::string name;
  io::SharedIdentity identity;
  std::vector<std::uint64_t> received;  // rank 0: the digest of each rank's planning payload, as received
  bool committed = false;               // rank 0: the checkpoint is at its path
};

// Rank 0's verdict on every rank's plan: validated together, the skeleton created in a fresh
// temporary file beside the destination (a link at `path` is followed: the checkpoint replaces its
// target), and for every rank that file, the datasets' extents and where its checksums start.
Bytes create_checkpoint(const std::vector<std::span<const std::byte>>& payloads, const fs::path& path,
                        const SaveOptions& options, SaveTarget& dest) {
  CheckpointContents contents;
  contents.id = io::random_id();
  contents.checksummed = options.checksums;
  for (std::span<const std::byte> p : payloads) dest.received.push_back(digest(p));
  Planned planned = validate_in_parts(payloads, contents);
  if (!options.checksums) planned.checksum_rows = 0;
  io::Destination where = io::Destination::of(path, options.follow_links);
  dest.dir = where.path.parent_path();
  // Ranks on other machines open the file next: it is synced first (a network file system needs that
  // for them to see it). Ranks of this machine see it as it is, through its page cache.
  dest.checkpoint.emplace(CheckpointWriter::create(std::move(where), planned.specs, contents, planned.checksum_rows,
                                                   !planned.one_machine));
  const Skeleton& skeleton = dest.checkpoint->skeleton();
  Writer w;
  w.str(dest.dir.string());
  w.str(dest.checkpoint->temporary().name());
  put_identity(w, dest.checkpoint->temporary().identity());
  w.i64(static_cast<std::int64_t>(skeleton.datasets.size()));
  for (const Dataset& d : skeleton.datasets) put_dataset(w, d);
  w.i64(static_cast<std::int64_t>(skeleton.checksums_address));
  w.dims(options.checksums ? planned.first_checksums : std::vector<std::int64_t>{});
  w.u8(planned.one_machine ? 1 : 0);
  return w.take();
}

// What every rank learns from the verdict: the datasets it writes, and its checksum slot (none
// without checksums).
struct Created {
  std::vector<Dataset> datasets;
  std::optional<ChecksumSlot> slot;
  bool one_machine = false;  // every rank shares rank 0's page cache: its seal syncs every rank's pieces
};

Created read_verdict(const Bytes& verdict, const SavePlan& plan, int me, int ranks, SaveTarget& dest) {
  Reader r(verdict);
  dest.dir = r.str();
  dest.name = r.str();
  dest.identity = get_identity(r);
  // Only the datasets this rank writes: what a rank holds grows with its own pieces, not the model.
  std::set<std::string_view> mine;
  for (const SaveItem& i : plan.items)
    if (i.writes) mine.insert(i.key);
  Created out;
  for (std::int64_t n = r.i64(); n > 0; --n) {
    Dataset d = get_dataset(r);
    if (mine.contains(d.key)) out.datasets.push_back(std::move(d));
  }
  const auto checksums_address = static_cast<std::uint64_t>(r.i64());
  const std::vector<std::int64_t> first_checksums = r.dims();
  require(first_checksums.empty() || first_checksums.size() == static_cast<std::size_t>(ranks), Errc::collective,
          "the planning verdict does not have one checksum start per rank");
  if (!first_checksums.empty()) out.slot = ChecksumSlot{checksums_address, first_checksums[static_cast<std::size_t>(me)]};
  out.one_machine = r.u8() == 1;
  return out;
}

// What a rank sent and received in planning, as digests: rank 0 commits only when every rank's match
// what it received and sent. A process group that delivers other bytes than were sent (a planning
// payload, or the verdict that places each rank's rows and checksums) would otherwise commit a file
// whose checksums do not describe it.
struct Digests {
  std::uint64_t sent = 0, verdict = 0;
};

Bytes digests_payload(const Digests& d) {
  Writer w;
  w.i64(static_cast<std::int64_t>(d.sent));
  w.i64(static_cast<std::int64_t>(d.verdict));
  return w.take();
}

void check_digests(const std::vector<std::span<const std::byte>>& payloads, const SaveTarget& dest,
                   std::uint64_t verdict) {
  for (std::size_t rank = 0; rank < payloads.size(); ++rank) {
    Reader r(payloads[rank]);
    const auto sent = static_cast<std::uint64_t>(r.i64());
    const auto seen = static_cast<std::uint64_t>(r.i64());
    require(rank < dest.received.size() && sent == dest.received[rank], Errc::collective, "the process group delivered "
            "other bytes to rank 0 than rank ", rank, " sent in planning: nothing is committed");
    require(seen == verdict, Errc::collective, "the process group delivered other bytes to rank ", rank,
            " than rank 0 sent as the planning verdict: nothing is committed");
  }
}

// The last step: every rank runs `write` (the raw path's write step, or nothing: the hyperslab path
// wrote in turns before), closes the file and sends its outcome; once every rank has written and
// synced its pieces, rank 0 says so (`committing`), checks the digests, seals and commits, and tells
// every rank. A rank that failed to write fails every rank here, before rank 0 seals anything. A
// rank whose group fails after that learns what it can: rank 0 knows the checkpoint is committed
// (Errc::committed_peer_failed), the others that the outcome is unknown to them.
void commit(ProcessGroup& group, SaveTarget& dest, const Digests& mine, const std::function<void()>& write,
            const std::function<void()>& committing) {
  const std::string_view phase = write ? "writing pieces and committing the checkpoint" : "committing the checkpoint";
  const std::vector<Bytes> gathered = Protocol::gather(group, outcome([&] {
    if (write) write();
    if (dest.opened) dest.opened->close();
    return digests_payload(mine);
  }), 0);
  Bytes verdict;
  if (group.rank() == 0)
    verdict = outcome([&] {
      const auto payloads = payloads_or_throw(phase, gathered);
      committing();
      check_digests(payloads, dest, mine.verdict);
      require(dest.checkpoint && dest.mine, Errc::internal, "rank 0 seals a checkpoint it did not write its pieces of");
      std::move(*dest.checkpoint).written(std::move(*dest.mine)).seal().commit();
      dest.committed = true;
      return Bytes();
    });
  Bytes shared;
  try {
    shared = group.broadcast(verdict, 0);
  } catch (const std::exception& e) {
    if (dest.committed)
      throw Error(Errc::committed_peer_failed, cat("the checkpoint is committed and complete, but the process group "
                                                   "failed as rank 0 told the other ranks: ", e.what()));
    throw Error(Errc::collective, cat("the process group failed while rank 0 committed the checkpoint: whether it "
                                      "did is unknown to rank ", group.rank(), " (verify the path): ", e.what()));
  }
  (void)payload_or_throw(shared);
}

// Every rank writes its own pieces and their checksums: all at once on the raw path; on the
// hyperslab path one rank at a time, since HDF5 must not have one file open for writing in two
// processes. Each rank first opens the temporary file rank 0 created and checks that it is that file.
// The raw path's step is returned, for the commit's first exchange to run (commit): one round less,
// which a small save feels. The hyperslab path writes here, a round per rank, and returns nothing.
std::function<void()> write_pieces(ProcessGroup& group, const SavePlan& plan, const Created& created,
                                   SaveTarget& dest, const SaveOptions& options, const RowsStaged& staged) {
  const auto open = [&] {
    if (!dest.checkpoint) dest.opened.emplace(io::TemporaryFile::open_created(dest.dir, dest.name, dest.identity));
  };
  const auto write_mine = [&] {
    std::optional<std::int64_t> first;
    if (created.slot) first = created.slot->first_checksum;
    PieceWriter writer = dest.checkpoint ? dest.checkpoint->pieces(options.method, first, options.progress)
                                         : PieceWriter(*dest.opened, options.method, created.slot, options.progress);
    // On rank 0's machine, rank 0's seal syncs the file, every rank's pieces with it: one sync, not one
    // per rank (ranks on other machines sync their own, which a network file system needs).
    if (!dest.checkpoint && created.one_machine) writer.leave_sync_to_the_seal();
    write_items(plan, created.datasets, writer, options.staging, staged);
    PiecesWritten done = writer.finish();
    if (dest.checkpoint) dest.mine.emplace(std::move(done));
  };
  // The raw path: each rank opens the file and writes its pieces in one step (a rank that cannot open
  // it fails the step like one that cannot write; rank 0's pieces written meanwhile go with the
  // temporary file).
  if (options.method == IoMethod::raw)
    return [open, write_mine] {
      open();
      write_mine();
    };
  agree(group, "opening the temporary file", open);
  for (int turn = 0; turn < group.size(); ++turn)
    agree(group, "writing pieces", [&] {
      if (turn == group.rank()) write_mine();
    });
  return {};
}

}  // namespace

// A save of the plan that `make_plan` returns on each rank (called once, in the planning phase, so
// that its errors are the save's collective errors); `staged` is told as rows leave the plan's memory.
void save_with(const std::function<SavePlan()>& make_plan, const fs::path& path, ProcessGroup& group,
               const SaveOptions& options, const RowsStaged& staged) {
  require_thread_safe_hdf5(group.threads_of_one_process() && group.size() > 1);
  const ForbidMaterialization no_copies;
  const int me = group.rank();
  const auto phase = [&](SavePhase p) {
    if (me == 0 && options.on_phase) options.on_phase(p);
  };
  SaveTarget dest;
  try {
    SavePlan plan;
    Digests digests;
    phase(SavePhase::planning);
    // 1. Every rank's claims reach rank 0 only, which validates them all together before anything
    // touches the disk and creates the file with every dataset at its global shape.
    const Bytes verdict = decide_at_root(
        group, "planning, validating and creating the checkpoint",
        [&] {
          // A rank that refused its input says so here, in the first exchange: every rank fails at once.
          require(options.refused.empty(), Errc::invalid_argument, options.refused);
          plan = make_plan();
          Bytes payload = planning_payload(plan, path, me);
          digests.sent = digest(payload);
          return payload;
        },
        [&](const std::vector<std::span<const std::byte>>& payloads) {
          return create_checkpoint(payloads, path, options, dest);
        });
    digests.verdict = digest(verdict);
    const Created created = read_verdict(verdict, plan, me, group.size(), dest);
    // 2. Every rank writes and syncs its pieces.
    phase(SavePhase::writing);
    const std::function<void()> write = write_pieces(group, plan, created, dest, options, staged);
    // 3. Only when every rank has written and synced its pieces does rank 0 seal and commit.
    commit(group, dest, digests, write, [&] { phase(SavePhase::committing); });
    phase(SavePhase::committed);
  } catch (Error& e) {
    // Unless rank 0 committed it, the temporary file it created goes (after a commit, nothing does).
    dest.checkpoint.reset();
    throw std::move(e.add_context(cat("saving ", path.string())));
  }
}

void save(const StateDict& state, const fs::path& path, ProcessGroup& group, SaveOptions options) {
  save_with([&] { return prepare_save(state); }, path, group, options);
}

void save(const StateDict& state, const fs::path& path, SaveOptions options) {
  SoloGroup solo;
  save(state, path, solo, options);
}

}  // namespace shardckpt
