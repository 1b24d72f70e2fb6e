module;
#include <hdf5.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;
import :raw;

#if SHARDCKPT_XXH3_AVX2
extern "C" __attribute__((visibility("hidden"))) std::uint64_t shardckpt_xxh3_avx2(const void* bytes, std::size_t n) noexcept;
#endif

namespace shardckpt {

// XXH3-64 with the widest vectors this CPU has: the AVX2 build where it runs (the same hash).
std::uint64_t row_hash(const void* bytes, std::size_t n) noexcept {
#if SHARDCKPT_XXH3_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return shardckpt_xxh3_avx2(bytes, n);
#endif
  return static_cast<std::uint64_t>(XXH3_64bits(bytes, n));
}

namespace {
namespace fs = std::filesystem;
using hdf5::check;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;
}  // namespace

std::string rows_text(const Box& box, const Box& whole) {
  return cat("rows [", box.rows.begin, ", ", box.rows.end, ")",
             box.cols == whole.cols ? std::string()
                                    : cat(" (elements [", box.cols.begin, ", ", box.cols.end, ") of each row)"));
}

std::vector<RawRegion> raw_regions_of(hid_t set, hid_t type, const std::vector<std::int64_t>& shape, DType dtype,
                               const Where& w) {
  const Box whole = whole_box(shape);
  if (whole.empty() || !hdf5::stored_exactly(type, dtype)) return {};
  Hid dcpl = owned(H5Dget_create_plist(set), H5Pclose, w, Errc::not_a_checkpoint);
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout == H5D_CONTIGUOUS) {
    const haddr_t addr = H5Dget_offset(set);
    H5Eclear2(H5E_DEFAULT);  // an unallocated dataset has no address: not an error here
    if (addr == HADDR_UNDEF) return {};
    return {{whole, addr}};
  }
  if (layout != H5D_CHUNKED || check(H5Pget_nfilters(dcpl.get()), w, Errc::not_a_checkpoint) != 0) return {};
  const std::size_t rank = shape.size();
  std::vector<hsize_t> dims(rank);
  if (check(H5Pget_chunk(dcpl.get(), static_cast<int>(rank), dims.data()), w, Errc::not_a_checkpoint) !=
      static_cast<int>(rank))
    return {};
  for (hsize_t d : dims)
    if (d == 0 || d > static_cast<hsize_t>(std::numeric_limits<std::int32_t>::max())) return {};
  // The dim the chunks split besides dim 0 (1 when none does); every other dim is whole.
  std::size_t k = 1;
  for (std::size_t d = 2; d < rank; ++d)
    if (static_cast<std::int64_t>(dims[d]) != shape[d]) k = d;
  for (std::size_t d = 1; d < rank; ++d)
    if (d != k && static_cast<std::int64_t>(dims[d]) != shape[d]) return {};
  std::int64_t inner = 1, before = 1;  // elements of one index of dim k; indices of dims 1..k-1
  for (std::size_t d = k + 1; d < rank; ++d) inner *= shape[d];
  for (std::size_t d = 1; d < k && d < rank; ++d) before *= shape[d];
  const auto chunk_rows = static_cast<std::int64_t>(dims[0]);
  const std::int64_t chunk_dimk = rank > 1 ? static_cast<std::int64_t>(dims[k]) : 1;
  const std::int64_t dimk = rank > 1 ? shape[k] : 1;
  // Past dim 1 the bands must divide the dim: a run of an edge chunk would reach into the next index.
  if (k > 1 && dimk % chunk_dimk != 0) return {};
  const std::int64_t chunk_cols = chunk_dimk * inner;
  const std::int64_t row_chunks = (shape[0] + chunk_rows - 1) / chunk_rows;
  const std::int64_t col_chunks = (dimk + chunk_dimk - 1) / chunk_dimk;
  if (row_chunks > max_raw_chunks || col_chunks > max_raw_chunks / std::max<std::int64_t>(row_chunks, 1))
    return {};
  const std::int64_t chunk_bytes = checked_mul(
      checked_mul(checked_mul(chunk_rows, chunk_cols, "chunk size", Errc::not_a_checkpoint), before, "chunk size",
                  Errc::not_a_checkpoint),
      element_bytes(dtype), "chunk size", Errc::not_a_checkpoint);
  std::vector<RawRegion> out;
  std::vector<hsize_t> offset(rank, 0);
  for (std::int64_t rc = 0; rc < row_chunks; ++rc)
    for (std::int64_t cc = 0; cc < col_chunks; ++cc) {
      offset[0] = static_cast<hsize_t>(rc * chunk_rows);
      if (rank > 1) offset[k] = static_cast<hsize_t>(cc * chunk_dimk);
      unsigned filters = 0;
      haddr_t addr = HADDR_UNDEF;
      hsize_t size = 0;
      if (H5Dget_chunk_info_by_coord(set, offset.data(), &filters, &addr, &size) < 0 || addr == HADDR_UNDEF ||
          size != static_cast<hsize_t>(chunk_bytes)) {
        H5Eclear2(H5E_DEFAULT);  // chunks never written are not allocated: part of the data has no address
        return {};
      }
      const std::int64_t row = rc * chunk_rows, col = cc * chunk_cols;
      out.push_back({{{row, row + chunk_rows}, {col, col + chunk_cols}}, addr, before, dimk * inner});
    }
  return out;
}

void check_box(const Dataset& d, const Box& box, DType dtype, std::size_t bytes, const fs::path& file) {
  require(dtype == d.dtype, Errc::dtype_mismatch, "key ", d.key, ": the dataset holds ", dtype_name(d.dtype),
          " but the tensor is ", dtype_name(dtype));
  const Box whole = whole_box(d.shape);
  require(box.rows.begin >= 0 && box.rows.end <= whole.rows.end && box.cols.begin >= 0 &&
              box.cols.end <= whole.cols.end && box.rows.begin <= box.rows.end && box.cols.begin <= box.cols.end,
          Errc::invalid_argument, "key ", d.key, " of ", file.string(), ": ", rows_text(box, whole),
          " are outside the dataset's ", dims_text(d.shape));
  const auto n = static_cast<std::size_t>(checked_mul(box_elements(box), element_bytes(d.dtype), "slab bytes"));
  require(n == bytes, Errc::shape_mismatch, "key ", d.key, ": a slab of ", n, " bytes does not match a tensor of ",
          bytes, " bytes");
}

}  // namespace shardckpt
