// shardckpt.storage:writer: how a checkpoint file is written. Rank 0 creates the skeleton (every
// dataset allocated at its global shape, the metadata, the checksum table); every rank writes its
// pieces into it straight from the caller's memory and the checksum of every row it writes; rank 0
// marks it complete and seals it. Writes copy nothing, and a write that fails fails the save: the
// file is a temporary one (storage:file) until it is committed. Knows nothing of ranks.
module;
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module shardckpt.storage:writer;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :file;
import :format;

export namespace shardckpt {

// A created, unwritten checkpoint: its datasets (with extents, in key order), where the checksum
// table starts in the file, and every range of raw data (tensors and the checksum table): all
// other bytes are HDF5 metadata, which mark_complete seals.
struct Skeleton {
  std::vector<Dataset> datasets;
  std::uint64_t checksums_address = 0;
  std::vector<Range> data;  // byte ranges [begin, end)
};

// Writes into the empty file `file` (a save's temporary file, io::TemporaryFile) every dataset
// allocated at its full shape, unwritten, a checksum table of `checksum_rows` entries (none unless
// contents.checksummed), and the metadata, but does not mark it complete. Every write error (a full
// disk, a file-size limit, EIO) is an Error{Errc::io}; nothing of HDF5 stays open afterwards.
// `shared`: other processes open the file next (a save's other ranks), so it is flushed to stable
// storage first, as a network file system needs for them to see it; a file only this process
// writes is synced once, by its seal.
Skeleton create_skeleton(io::File& file, std::span<const Dataset> datasets, const CheckpointContents& contents,
                         std::int64_t checksum_rows, bool shared = true);

// Where a writer's checksums go: the table's address in the file and the index of the writer's first checksummed row.
struct ChecksumSlot {
  std::uint64_t table_address = 0;
  std::int64_t first_checksum = 0;
};

class PieceWriter;
class CheckpointWriter;

// Proof that a writer's pieces and their checksums reached the file: on stable storage, or (the
// writer a CheckpointWriter made for its own file) in the file that its seal flushes to stable
// storage before the commit. Only PieceWriter::finish and CheckpointWriter::write_checksums make
// one, and only the checkpoint of the same file takes it (CheckpointWriter::written): a checkpoint
// cannot be sealed before its own pieces are written.
class [[nodiscard]] PiecesWritten {
 public:
  PiecesWritten(PiecesWritten&&) noexcept = default;
  PiecesWritten& operator=(PiecesWritten&&) noexcept = default;

 private:
  friend class PieceWriter;
  friend class CheckpointWriter;
  explicit PiecesWritten(const io::File& file) noexcept : file_(&file) {}
  const io::File* file_;  // compared, never followed: which file the pieces went to
};

// Writes pieces into a skeleton and the checksum of every row it writes. Writes copy nothing: HDF5
// or pwrite read the caller's rows (rows in a mapping of a file excepted: they are copied first,
// guarded). Each row is hashed before it is written and again after: a row that changed meanwhile
// (another thread writing the caller's tensor) is Errc::shard_changed naming the key, the row and
// the file, so that the checksums describe the bytes in the file. The checksums of its rows fill
// the table from the slot's first unit on, in write order, which must be the order the skeleton's
// slabs were planned in. No slot: the checkpoint has no checksums.
class PieceWriter {
 public:
  // Writes into `file` (a skeleton, opened for writing), which must outlive the writer.
  PieceWriter(io::File& file [[clang::lifetimebound]], IoMethod method, std::optional<ChecksumSlot> checksums,
              BytesDone progress = {});
  PieceWriter(PieceWriter&&) noexcept;
  PieceWriter& operator=(PieceWriter&&) noexcept;
  ~PieceWriter();

  // Writes `src` (box.rows rows of box.cols elements) over `box` of the dataset.
  void write(const Dataset& dataset, const Box& box, TensorView src);
  // The same for the slab at `offset` with extent `count`; only dims 0 and 1 may be partial.
  void write(const Dataset& dataset, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
             TensorView src);
  // Writes the checksums and flushes everything to stable storage, checking every step (a writer of
  // CheckpointWriter::pieces leaves the flush to the seal, which syncs the same file).
  PiecesWritten finish();
  // finish() then leaves the flush to stable storage to the caller, who syncs the same file later
  // from a process of this machine (a save whose ranks share one kernel: rank 0's seal syncs every
  // rank's pieces). The pieces are written either way.
  void leave_sync_to_the_seal();

 private:
  friend class CheckpointWriter;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class WrittenCheckpoint;
class SealedCheckpoint;
struct CheckpointState;

// The one way to write a checkpoint file, each step a type: created (the skeleton in a fresh
// temporary file beside the destination, storage:file) -> written (this writer's pieces on stable
// storage, and those of the other ranks the caller waited for) -> sealed (marked complete, its
// metadata sealed) -> committed (renamed over the destination). Each step consumes the one before
// (`std::move(w).written(...)`), so steps out of order do not compile, and a step taken twice on one
// object is a -Wconsumed diagnostic (an error in this project's flags) and, where the analysis cannot
// see it, an Error{Errc::invalid_argument} at run time. A checkpoint dropped at any step before its
// commit removes its temporary file. Moving a step keeps the file where it is: a PieceWriter made by
// pieces() stays valid until the commit.
class [[clang::consumable(unconsumed)]] CheckpointWriter {
 public:
  // Creates the temporary file beside `dest` and the skeleton in it (create_skeleton; `shared`:
  // other processes write into it too).
  static CheckpointWriter create(io::Destination dest, std::span<const Dataset> datasets,
                                 const CheckpointContents& contents, std::int64_t checksum_rows, bool shared = true);
  CheckpointWriter(CheckpointWriter&&) noexcept;
  CheckpointWriter& operator=(CheckpointWriter&&) noexcept;
  ~CheckpointWriter();

  [[clang::callable_when(unconsumed)]] const Skeleton& skeleton() const [[clang::lifetimebound]];
  // The temporary file (its name and identity tell other ranks which file to open).
  [[clang::callable_when(unconsumed)]] const io::TemporaryFile& temporary() const [[clang::lifetimebound]];
  // A writer of pieces into this file whose checksums fill the table from `first_checksum` on (none:
  // the checkpoint has no checksums).
  [[clang::callable_when(unconsumed)]] PieceWriter pieces(IoMethod method, std::optional<std::int64_t> first_checksum,
                                                          BytesDone progress = {}) [[clang::lifetimebound]];
  // For data outside the file (an adopted one): the checksum table written whole and synced.
  [[clang::callable_when(unconsumed)]] PiecesWritten write_checksums(std::span<const std::uint64_t> hashes);
  // The next step, given the proof that this file's pieces are written.
  [[clang::callable_when(unconsumed)]] [[clang::set_typestate(consumed)]] WrittenCheckpoint written(PiecesWritten done) &&;

 private:
  explicit CheckpointWriter(std::unique_ptr<CheckpointState> state) noexcept;
  std::unique_ptr<CheckpointState> state_;
};

class [[clang::consumable(unconsumed)]] WrittenCheckpoint {
 public:
  WrittenCheckpoint(WrittenCheckpoint&&) noexcept;
  WrittenCheckpoint& operator=(WrittenCheckpoint&&) noexcept;
  ~WrittenCheckpoint();
  // Gives the file its final mode and group (io::TemporaryFile::take_destination_mode), marks it
  // complete and seals it (mark_complete), which syncs it once for all three.
  [[clang::callable_when(unconsumed)]] [[clang::set_typestate(consumed)]] SealedCheckpoint seal() &&;

 private:
  friend class CheckpointWriter;
  explicit WrittenCheckpoint(std::unique_ptr<CheckpointState> state) noexcept;
  std::unique_ptr<CheckpointState> state_;
};

class [[clang::consumable(unconsumed)]] SealedCheckpoint {
 public:
  SealedCheckpoint(SealedCheckpoint&&) noexcept;
  SealedCheckpoint& operator=(SealedCheckpoint&&) noexcept;
  ~SealedCheckpoint();
  // Renames the file over its destination (io::TemporaryFile::commit); the last step.
  [[clang::callable_when(unconsumed)]] [[clang::set_typestate(consumed)]] void commit() &&;

 private:
  friend class WrittenCheckpoint;
  explicit SealedCheckpoint(std::unique_ptr<CheckpointState> state) noexcept;
  std::unique_ptr<CheckpointState> state_;
};

// Marks a fully written skeleton complete, then seals it: for every 4 KiB page of the file that
// holds bytes outside `data` (its HDF5 metadata), the XXH3-64 of those bytes goes into a trailer
// past HDF5's end of the file, which a reader checks before HDF5 parses anything and again on every
// read HDF5 makes, so that damaged or changed metadata is refused rather than trusted to HDF5's
// parser. Flushes to disk. The caller then commits the file (io::TemporaryFile::commit). A save
// takes these steps through CheckpointWriter; tests call them alone.
void mark_complete(io::File& file, std::span<const Range> data);

}  // namespace shardckpt
