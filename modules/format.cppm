// shardckpt.format: the checkpoint file format (docs/format.md) and the code that writes and reads
// it. A checkpoint is one HDF5 file: every tensor key is a dataset at the root with its global
// shape, so h5ls, h5dump and h5py see plain tensors; library metadata sits in the group
// /_shardckpt. Every row of every slab a rank writes carries an XXH3-64 checksum, computed while it
// is written, so that a load at any layout checks exactly the bytes it reads. Pieces are written
// straight from the caller's memory by HDF5 hyperslab writes or by positional writes at the file
// addresses of their data (the direct path); reads mirror them into the caller's rows. The reader
// treats the file as hostile: every attribute, shape, address and table is checked before use.
// This module never allocates a tensor and knows nothing of ranks or process groups.
module;
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>
export module shardckpt.format;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.io;

export namespace shardckpt {

// 1: parameters and common values; 2: adds data checksums and the checkpoint id. Both are read.
inline constexpr int format_version = 2;

// Where one rank's piece sits in its global dataset (local checkpoints keep it beside the data).
struct PiecePlacement {
  std::string key;  // the global dataset's key
  std::vector<std::int64_t> global_shape;
  Box box;
  friend bool operator==(const PiecePlacement&, const PiecePlacement&) = default;
};

// What one writer covers of a dataset (a box of rows x flattened trailing elements) and the index
// of the checksum of its first row in the checkpoint's checksum table; its other rows follow.
struct Slab {
  Box box;
  std::int64_t first_checksum = 0;
};
// Checksummed rows of a box: one per row, none for an empty box.
std::int64_t checksum_rows_of(const Box& box);

// A dataset whose bytes stay in another file (HDF5 external storage): `file` is a plain file name
// in the checkpoint's own directory, `offset` where the row-major bytes begin (see adopt()).
struct ExternalData {
  std::string file;
  std::uint64_t offset = 0;
};
// Raw data the raw path can address: the elements `box` of a dataset, stored row-major from
// `address` with rows of box.cols.size() elements. A contiguous dataset is one region; a chunked one
// has one per chunk (an edge chunk's box reaches past the data).
struct RawRegion {
  Box box;
  std::uint64_t address = 0;
};

// A tensor dataset: its key, dtype and global shape, and as far as they apply how it is stored: where
// a local file's piece belongs (placement), its chunk dims (empty: contiguous, see datasets_of), the
// slabs its writers fill, external storage (adopted files), and the raw regions its bytes lie in
// (filled by create_skeleton for the writers' raw path; a reader finds them itself).
struct Dataset {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::optional<PiecePlacement> placement = {};
  std::vector<std::int64_t> chunk = {};
  std::vector<Slab> slabs = {};
  std::optional<ExternalData> external = {};
  std::vector<RawRegion> regions = {};
};

// The datasets of a validated claim set, one per key in key order. `first_checksums[i]` is where the
// checksums of claims[i] start (ignored for replicas and empty claims). The chunking policy: a
// dataset whose pieces all split dim 1 into equal, aligned bands (row-parallel weights under TP) is
// chunked one band wide, so that each band's rows are contiguous bytes; the rest are contiguous.
std::vector<Dataset> datasets_of(std::span<const Claim> claims, std::span<const std::int64_t> first_checksums);


enum class CheckpointKind : std::uint8_t { global, local };

// Metadata of a checkpoint besides its datasets. `id` is unique per save (empty in version 1).
// `checksummed` is false for version 1 and for saves that asked for no checksums.
struct CheckpointContents {
  CheckpointKind kind = CheckpointKind::global;
  std::vector<ParamRecord> params;
  Values common;
  std::string id;
  bool checksummed = true;
};

enum class IoMethod : std::uint8_t { raw, hyperslab };

// Told how many more bytes of tensor data were written or read (progress reports).
using BytesDone = std::function<void(std::int64_t bytes)>;


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

// Where a writer's checksums go: the table's address in the file and the writer's first unit.
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

struct ReadOptions {
  IoMethod method = IoMethod::raw;
  // Check every byte read against its checksum (Errc::corrupt on a mismatch).
  bool verify = true;
  BytesDone progress = {};
  // Read tensor data around the page cache (O_DIRECT) where the file system allows it; see
  // io::BulkReader. Metadata and checksums always go through the page cache.
  bool bypass_page_cache = false;
};

struct OpenOptions {
  // The seal another rank already checked for this file: only compare the file's to it (0: the
  // file must be unsealed). Unset: check the whole seal here.
  std::optional<std::uint64_t> trusted_seal = {};
  // Refuse (Errc::not_a_checkpoint) a file without a seal: one whose metadata HDF5 would parse
  // unchecked (written by another tool, changed by one after the save, or written before seals).
  bool require_seal = false;
};

// An open, complete checkpoint. Metadata and data come from one open file: a path replaced while
// the reader is open does not change what it reads. Reads from many threads run in parallel on
// the direct path.
class CheckpointReader {
 public:
  // Throws Errc::corrupt when the file's seal shows its metadata was damaged, Errc::replaced when
  // it does not match options.trusted_seal, and Errc::not_a_checkpoint for a file that is not a
  // complete shardckpt checkpoint (missing, foreign, unfinished, truncated, or with metadata that
  // contradicts itself), naming the attribute.
  explicit CheckpointReader(const std::filesystem::path& path, OpenOptions options = {});
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const std::filesystem::path& path() const noexcept;
  int version() const noexcept;
  // False for checkpoints written before checksums existed (format version 1) or saved without.
  bool checksummed() const noexcept;
  io::FileIdentity identity() const;
  // The checksum of the file's HDF5 metadata, when it carries a seal; files written by other tools,
  // changed by them after the save, or written before seals existed carry none.
  std::optional<std::uint64_t> seal() const noexcept;
  // Kind, common values, id, and the parameter records as parsed (see params()).
  const CheckpointContents& contents() const noexcept;
  // What ranks compare to know that they opened the same checkpoint: a hash of the id, the seal's
  // digest, the file's size, the version, the kind, the records and the common values, so that two
  // files that share an id (a copy edited by another tool) are never taken for one.
  std::uint64_t fingerprint() const;
  // The parameter records, each checked against the datasets of its blocks (keys, shapes, one
  // dtype); a contradiction is Errc::not_a_checkpoint naming the record.
  const std::vector<ParamRecord>& params() const;
  // Every tensor dataset, in key order. Headers are read on first use.
  const std::vector<Dataset>& datasets() const;
  // Objects at the root that are not tensors (groups, scalar datasets, unsupported element types)
  // with the reason they are skipped.
  const std::vector<std::pair<std::string, std::string>>& skipped() const;
  // Throws Errc::missing_key, or Errc::not_a_checkpoint for a skipped object.
  const Dataset& dataset(std::string_view key) const;
  // The slabs a dataset was saved in, checked to tile it exactly (empty in version 1).
  std::vector<Slab> slabs(const Dataset& dataset) const;

  // Reads `box` of the dataset into `dst` (box rows of box width, the dataset's dtype).
  void read(const Dataset& dataset, const Box& box, MutTensorView dst, ReadOptions options = {}) const;
  // The same for the slab at `offset` with extent `count`.
  void read(const Dataset& dataset, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
            MutTensorView dst, ReadOptions options = {}) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// What verify_checkpoint found.
struct VerifyReport {
  bool checksummed = true;
  std::int64_t datasets = 0;
  std::int64_t bytes = 0;
  std::int64_t checksum_rows = 0;  // rows checked
  std::int64_t mismatches = 0;  // rows whose bytes differ from their checksum
  std::vector<std::string> problems;  // the first few, naming key and rows
};
// Makes the plain HDF5 file `plain` (datasets at the root with the non-GTP keys and global shapes,
// contiguous and unfiltered, as h5py writes them; no shardckpt metadata) loadable as a checkpoint
// without rewriting its data: writes the checkpoint `out`, in the same directory, whose datasets
// keep their bytes in `plain` (HDF5 external storage) and which carries the parameter records,
// `common`, the slab table and the checksum of every row (read from `plain` once). `plain` is not
// changed. Throws Errc::not_a_checkpoint naming a dataset it cannot adopt, Errc::invalid_argument
// when the records do not match the datasets, and Errc::io.
// `out` may not be `plain` itself (the same file through any link) and may not name anything but a
// regular file; it is written like a save (a temporary file, committed atomically).
struct AdoptReport {
  std::int64_t tensors = 0;
  std::int64_t params = 0;
  std::int64_t bytes = 0;
};
AdoptReport adopt(const std::filesystem::path& plain, const std::filesystem::path& out,
                  const std::vector<ParamRecord>& records, const Values& common);
// Parameter records as JSON text (the `params` attribute of docs/format.md), and back; throws
// Errc::invalid_argument for text that does not hold valid records.
std::string records_json(const std::vector<ParamRecord>& records);
std::vector<ParamRecord> parse_records(std::string_view json_text);

// Reads every byte of every tensor of the checkpoint and checks it against its checksum.
// `progress(bytes_done, bytes_total)` is called as it goes.
VerifyReport verify_checkpoint(const CheckpointReader& reader,
                               const std::function<void(std::int64_t, std::int64_t)>& progress = {});

}  // namespace shardckpt
