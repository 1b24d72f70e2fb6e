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
Skeleton create_skeleton(io::File& file, std::span<const Dataset> datasets, const CheckpointContents& contents,
                         std::int64_t checksum_rows);

// Where a writer's checksums go: the table's address in the file and the index of the writer's first checksummed row.
struct ChecksumSlot {
  std::uint64_t table_address = 0;
  std::int64_t first_checksum = 0;
};

// Writes pieces into a skeleton and the checksum of every row it writes. Writes copy nothing: HDF5
// or pwrite read the caller's rows. The checksums of its rows fill the table from the slot's first
// unit on, in write order, which must be the order the skeleton's slabs were planned in. No slot:
// the checkpoint has no checksums.
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
  // Writes the checksums and flushes everything to stable storage, checking every step.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Marks a fully written skeleton complete, then seals it: for every 4 KiB page of the file that
// holds bytes outside `data` (its HDF5 metadata), the XXH3-64 of those bytes goes into a trailer
// past HDF5's end of the file, which a reader checks before HDF5 parses anything and again on every
// read HDF5 makes, so that damaged or changed metadata is refused rather than trusted to HDF5's
// parser. Flushes to disk. The caller then commits the file (io::TemporaryFile::commit).
void mark_complete(io::File& file, std::span<const Range> data);

}  // namespace shardckpt
