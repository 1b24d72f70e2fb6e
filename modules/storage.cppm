// shardckpt.storage: the HDF5 checkpoint format (docs/format.md). A checkpoint is one HDF5 file;
// every tensor key is a dataset at the root with its global shape, so h5ls, h5dump and h5py see
// plain tensors; library metadata sits in the group /_shardckpt. Pieces are written straight from
// the caller's memory into their place in a dataset, by HDF5 hyperslab writes or by positional
// writes at the file addresses of its data (the direct path); reads mirror them into the caller's rows.
// Every HDF5 handle has an owner here; HDF5 errors become Error{Errc::hdf5} with file, key and
// operation. This module never allocates a tensor and knows nothing of ranks or process groups.
module;
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>
export module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;

export namespace shardckpt {

inline constexpr int format_version = 1;

// A value saved once for the whole checkpoint (iteration, configuration...).
using CommonValue = std::variant<std::int64_t, double, std::string>;

// A fused (or plain) parameter as the checkpoint records it: blocks with their global row counts,
// in row order, and the global trailing dims. Enough to plan the parameter at any TP.
struct ParamRecord {
  std::string key;
  TpAxis tp_axis = TpAxis::rows;
  std::vector<Section> blocks;
  std::vector<std::int64_t> trailing;
  friend bool operator==(const ParamRecord&, const ParamRecord&) = default;
};
ParamRecord record_of(const ParamSpec& spec);
ParamSpec spec_at_tp(const ParamRecord& record, int tp);

// Where one rank's piece sits in its dataset (local checkpoints keep it beside the data).
struct PiecePlacement {
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> global_offset;
  friend bool operator==(const PiecePlacement&, const PiecePlacement&) = default;
};

struct DatasetSpec {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::optional<PiecePlacement> placement;  // local checkpoints only
  bool placeholder = false;                 // zero-element stand-in of a padding-only rank
  // Chunk dims, or empty for a contiguous dataset. A dataset whose pieces split dim 1 is chunked by
  // column band, so that each band's rows are contiguous bytes rather than one run per row.
  std::vector<std::int64_t> chunk;
};

// Raw data the direct path can address: the elements `box` (rows x flat columns, see footprint) of a
// dataset, stored row-major from `address` with rows of box.cols.size() elements. A contiguous
// dataset is one extent; a chunked one has one per chunk (an edge chunk's box reaches past the data).
struct Extent {
  Box box;
  std::uint64_t address = 0;
};

// A dataset as found in (or created in) a file. `extents` cover the whole dataset when its raw data
// is allocated, unfiltered and stored in exactly the library's type, so the direct path may use it;
// otherwise they are empty and reads go through HDF5.
struct DatasetInfo {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::vector<Extent> extents;
  std::optional<PiecePlacement> placement;
  bool placeholder = false;
};

enum class CheckpointKind : std::uint8_t { global, local };

// Metadata of a checkpoint besides its datasets.
struct CheckpointContents {
  CheckpointKind kind = CheckpointKind::global;
  std::vector<ParamRecord> params;
  std::map<std::string, CommonValue, std::less<>> common;
};

enum class IoMethod : std::uint8_t { direct, hyperslab };

// The temporary name a save writes under before it commits: `<path>.partial`.
std::filesystem::path partial_path(const std::filesystem::path& path);

// Creates (truncating) the file at `path` with every dataset allocated at its full shape, unwritten,
// and the metadata, but not marked complete. Returns the datasets with their extents.
std::vector<DatasetInfo> create_skeleton(const std::filesystem::path& path, std::span<const DatasetSpec> datasets,
                                         const CheckpointContents& contents);

// Writes pieces into a skeleton. Each write copies nothing: HDF5 or pwrite read the caller's rows.
class PieceWriter {
 public:
  PieceWriter(const std::filesystem::path& path, IoMethod method);
  PieceWriter(PieceWriter&&) noexcept;
  PieceWriter& operator=(PieceWriter&&) noexcept;
  ~PieceWriter();

  // Writes `src` (count[0] rows) at `offset` with extent `count`; only dims 0 and 1 may be partial.
  void write(const DatasetInfo& dataset, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
             TensorView src);
  // Flushes everything written so far to stable storage, then closes.
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Marks a fully written skeleton complete and flushes it to disk.
void mark_complete(const std::filesystem::path& path);
// Atomically renames `partial` to `path` (replacing an earlier checkpoint) and syncs the directory.
void commit(const std::filesystem::path& partial, const std::filesystem::path& path);
// Removes a partial file after a failed save; never throws.
void discard(const std::filesystem::path& partial) noexcept;

// An open, complete checkpoint. Each rank opens its own; reads from many threads run in parallel on
// the direct path.
class CheckpointReader {
 public:
  // Throws Errc::not_a_checkpoint for a file that is not a complete shardckpt checkpoint (missing,
  // foreign, unfinished or truncated).
  explicit CheckpointReader(const std::filesystem::path& path);
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const std::filesystem::path& path() const noexcept;
  const CheckpointContents& contents() const noexcept;
  // Every dataset, in key order. Headers are read on first use, so these throw
  // Errc::not_a_checkpoint for a dataset that is truncated or of a type the library does not store.
  const std::vector<DatasetInfo>& datasets() const;
  // Throws Errc::missing_key.
  const DatasetInfo& dataset(std::string_view key) const;

  // Reads the slab at `offset`/`count` into `dst` (count[0] rows); `dst` must have the dataset's dtype.
  void read(const DatasetInfo& dataset, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
            MutTensorView dst, IoMethod method) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardckpt
