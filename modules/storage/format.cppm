// shardckpt.storage:format: what a checkpoint file holds, as values (docs/format.md): its version,
// the datasets (key, dtype, global shape, and how their bytes are stored), the slabs writers fill and
// the checksums of their rows, what a local file records of a piece's place, the metadata beside the
// datasets, and the chunking policy that lays a save's datasets out. Nothing here touches a file.
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
export module shardckpt.storage:format;
import shardckpt.core;
import shardckpt.layout;

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
// Raw data the raw path can address, stored from `address`: for each row of `box`, `runs` runs of
// box.cols.size() elements, run j holding the elements box.cols shifted by j * period, one after
// another, then the next row's. A contiguous dataset is one region of one run per row; a chunked one
// has a region per chunk (an edge chunk's box reaches past the data). A chunk split along a dim k
// past 1 holds, in each row, a run for each index of dims 1..k-1: runs = their product, period =
// the elements of one index of dim k-1.
struct RawRegion {
  Box box;
  std::uint64_t address = 0;
  std::int64_t runs = 1;
  std::int64_t period = 0;
};
// The elements a region's bytes hold.
inline std::int64_t region_elements(const RawRegion& e) { return box_elements(e.box) * e.runs; }

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
// dataset whose pieces all split one dim k >= 1 into equal, aligned bands (row-parallel weights
// under TP, layer-stacked or not) is chunked one band of dim k wide, so that each band's part of a
// row is contiguous bytes; the rest are contiguous.
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

}  // namespace shardckpt
