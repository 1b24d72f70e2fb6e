// shardckpt.storage:raw (implementation partition): raw data by address. Where a dataset's bytes lie
// in the file (raw regions), how a box of a dataset moves between those addresses and the caller's
// rows, the checksum of a row, and the sizes of the batches rows move in. It never moves a byte
// outside a dataset's checked raw regions.
module;
#include <hdf5.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>
module shardckpt.storage:raw;
import shardckpt.core;
import shardckpt.layout;
import :format;
import :hdf5;

namespace shardckpt {

// Checksums are over the bytes as stored (little-endian), and the raw path moves bytes as they lie
// in memory: both need a little-endian host.
static_assert(std::endian::native == std::endian::little, "shardckpt needs a little-endian host");

// Rows are written (and checked rows read) in batches of about this many bytes: small enough that a
// batch is still in cache when it is checksummed, large enough that calls are few.
constexpr std::int64_t batch_bytes = std::int64_t{1} << 20;
// Checked reads through the page cache hash each batch right after the kernel copied it: a quarter
// of the above keeps it in a core's L2 (docs/performance.md, "Constants"). Direct reads land in
// memory, not in a cache, and want fewer, larger reads.
constexpr std::int64_t cached_read_batch = std::int64_t{256} << 10, direct_read_batch = batch_bytes;
// Chunks of at most this many bytes (HDF5 caps a chunk at 4 GiB).
constexpr std::int64_t max_chunk_bytes = std::int64_t{1} << 30;
// Chunk lists longer than this (small chunks written by other tools) are read through HDF5: HDF5
// 1.10 finds one chunk's address in time linear in the chunks, so listing n costs n^2
// (docs/performance.md, "Constants"). A save chunks a dataset one TP band wide: far fewer chunks.
constexpr std::int64_t max_raw_chunks = 4096;
// Slabs in one dataset's table (5 values each) a reader accepts.
constexpr std::size_t max_slab_values = std::size_t{5} << 24;

// The checksum of a row of a slab (docs/format.md): XXH3-64 of its stored bytes.
std::uint64_t row_hash(const void* bytes, std::size_t n) noexcept;

// "rows [a, b)", and the elements of each row when `box` is narrower than `whole`.
std::string rows_text(const Box& box, const Box& whole);

// Where the raw data of an open dataset lies, when the raw path may use it: stored unfiltered in
// exactly the library's type, allocated in full, split (if chunked) along dim 0 and at most one
// other dim (past dim 1 only into equal bands). Empty where it may not.
std::vector<RawRegion> raw_regions_of(hid_t set, hid_t type, const std::vector<std::int64_t>& shape, DType dtype,
                                      const hdf5::Where& w);

// Moves `box` (a box of one dataset) between the file and memory, where memory row i of the box
// starts at mem + i * mem_stride bytes. For each run of each extent the box meets, `move(p, run,
// rows, at, file_stride)` moves `rows` rows of `run` bytes: file row i at at + i * file_stride,
// memory row i at p + i * mem_stride.
template <class Mem, class Move>
void transfer(const std::filesystem::path& file, std::span<const RawRegion> extents, std::int64_t es, const Box& box, Mem* mem,
              std::int64_t mem_stride, Move&& move) {
  std::int64_t moved = 0;
  for (const RawRegion& e : extents) {
    const std::int64_t width = e.box.cols.size(), first = e.box.cols.begin;
    const std::int64_t file_stride = width * e.runs * es;
    // The runs that may meet the box's elements: run j holds [first + j * period, ... + width).
    std::int64_t j0 = 0, j1 = 1;
    if (e.runs > 1) {
      if (box.cols.end <= first || e.period <= 0) continue;
      j0 = box.cols.begin <= first ? 0 : (box.cols.begin - first) / e.period;
      j1 = std::min(e.runs, (box.cols.end - 1 - first) / e.period + 1);
    }
    for (std::int64_t j = j0; j < j1; ++j) {
      const Range cols{first + j * e.period, first + j * e.period + width};
      const Box hit = box.intersect({e.box.rows, cols});
      if (hit.empty()) continue;
      moved += box_elements(hit);
      const std::int64_t run = hit.cols.size() * es;
      const std::uint64_t at =
          e.address + static_cast<std::uint64_t>(
                          ((hit.rows.begin - e.box.rows.begin) * width * e.runs + j * width + hit.cols.begin - cols.begin) * es);
      move(mem + (hit.rows.begin - box.rows.begin) * mem_stride + (hit.cols.begin - box.cols.begin) * es,
           static_cast<std::size_t>(run), static_cast<std::size_t>(hit.rows.size()), at, file_stride);
    }
  }
  require(moved == box_elements(box), Errc::not_a_checkpoint, file.string(),
          ": the dataset's chunks do not cover the slab being moved");
}

// Rows per batch of about `batch` bytes for rows of `row_bytes`.
inline std::int64_t batch_rows(std::int64_t row_bytes, std::int64_t batch = batch_bytes) {
  return std::max<std::int64_t>(1, batch / std::max<std::int64_t>(row_bytes, 1));
}

// Checks a box against a dataset and the caller's tensor of `bytes`.
void check_box(const Dataset& d, const Box& box, DType dtype, std::size_t bytes, const std::filesystem::path& file);
inline Box box_of(const Dataset& d, std::span<const std::int64_t> offset, std::span<const std::int64_t> count) {
  return footprint(d.key, d.shape, offset, count);
}

}  // namespace shardckpt
