module;
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :raw;

namespace shardckpt {

std::int64_t checksum_rows_of(const Box& box) { return box.empty() ? 0 : box.rows.size(); }

namespace {

// The chunk dims of band chunking, if it applies: with `width` the elements of the widest slab, a dim
// k >= 1 of which `width` is a band (a whole number of indices of dim k that divides the elements of
// one index of dim k-1, without equalling them) such that every slab lies inside one band of one
// index of dims 1..k-1. The chunk is one band of dim k wide, whole in every other dim but dim 0, as
// many rows as fit in max_chunk_bytes; nothing when the chunks would number past max_raw_chunks.
std::optional<std::vector<std::int64_t>> band_chunk(const std::vector<std::int64_t>& shape, DType dtype,
                                                    std::int64_t width, std::span<const Slab> slabs) {
  if (shape.size() < 2 || shape[0] <= 0 || width <= 0) return std::nullopt;
  std::int64_t inner = 1;  // elements of one index of dim k
  for (std::size_t k = shape.size() - 1; k >= 1; inner *= shape[k--]) {
    const std::int64_t period = checked_mul(shape[k], inner, "elements of a dataset's row");  // one index of dim k-1
    if (width % inner != 0 || width >= period || period % width != 0) continue;
    for (const Slab& s : slabs) {
      const std::int64_t a = s.box.cols.begin, b = s.box.cols.end - 1;
      if (a / period != b / period || a % period / width != b % period / width) return std::nullopt;
    }
    std::vector<std::int64_t> chunk = shape;
    chunk[k] = width / inner;
    const std::int64_t row_elements = whole_box(shape).cols.end / period * width;  // of one chunk
    const std::int64_t row_bytes = checked_mul(element_bytes(dtype), row_elements, "chunk row bytes");
    chunk[0] = std::clamp<std::int64_t>(max_chunk_bytes / row_bytes, 1, shape[0]);
    // The raw path must find every chunk (see max_raw_chunks); past that, contiguous.
    const std::int64_t chunks = (shape[0] + chunk[0] - 1) / chunk[0] * (period / width);
    if (chunks > max_raw_chunks) return std::nullopt;
    return chunk;
  }
  return std::nullopt;
}

}  // namespace

std::vector<Dataset> datasets_of(std::span<const Claim> claims, std::span<const std::int64_t> first_checksums) {
  require(first_checksums.size() == claims.size(), Errc::internal, "one first checksum per claim");
  std::map<std::string_view, std::vector<std::size_t>> by_key;
  for (std::size_t i = 0; i < claims.size(); ++i) by_key[claims[i].key].push_back(i);
  std::vector<Dataset> out;
  out.reserve(by_key.size());
  for (const auto& [key, list] : by_key) {
    const Claim& c0 = claims[list.front()];
    Dataset spec{c0.key, c0.dtype, c0.global_shape};
    // Band chunking: the widest box is one band of a dim k, and every box lies inside one band.
    const std::vector<std::int64_t>& shape = c0.global_shape;
    std::int64_t width = 0;
    for (std::size_t i : list) {
      const Claim& c = claims[i];
      if (c.writes && !c.box.empty()) {
        spec.slabs.push_back({c.box, first_checksums[i]});
        width = std::max(width, c.box.cols.size());
      }
    }
    if (const std::optional<std::vector<std::int64_t>> chunk = band_chunk(shape, c0.dtype, width, spec.slabs))
      spec.chunk = *chunk;
    std::sort(spec.slabs.begin(), spec.slabs.end(), [](const Slab& a, const Slab& b) {
      return a.box.rows.begin != b.box.rows.begin ? a.box.rows.begin < b.box.rows.begin
                                                  : a.box.cols.begin < b.box.cols.begin;
    });
    out.push_back(std::move(spec));
  }
  return out;
}

}  // namespace shardckpt
