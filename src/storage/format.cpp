module;
#include <algorithm>
#include <cstdint>
#include <map>
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

std::vector<Dataset> datasets_of(std::span<const Claim> claims, std::span<const std::int64_t> first_checksums) {
  require(first_checksums.size() == claims.size(), Errc::internal, "one first checksum per claim");
  std::map<std::string_view, std::vector<std::size_t>> by_key;
  for (std::size_t i = 0; i < claims.size(); ++i) by_key[claims[i].key].push_back(i);
  std::vector<Dataset> out;
  out.reserve(by_key.size());
  for (const auto& [key, list] : by_key) {
    const Claim& c0 = claims[list.front()];
    Dataset spec{c0.key, c0.dtype, c0.global_shape};
    // Band chunking: the widest box is one band of the row, and every box lies inside one band.
    const std::vector<std::int64_t>& shape = c0.global_shape;
    const Box whole = whole_box(shape);
    std::int64_t width = 0;
    for (std::size_t i : list) {
      const Claim& c = claims[i];
      if (c.writes && !c.box.empty()) {
        spec.slabs.push_back({c.box, first_checksums[i]});
        width = std::max(width, c.box.cols.size());
      }
    }
    const std::int64_t inner = shape.size() >= 2 ? element_count(std::span(shape).subspan(2)) : 1;
    bool banded = shape.size() >= 2 && shape[0] > 0 && width > 0 && width < whole.cols.end &&
                  whole.cols.end % width == 0 && width % inner == 0;
    for (const Slab& s : spec.slabs)
      banded = banded && s.box.cols.begin / width == (s.box.cols.end - 1) / width;
    if (banded) {
      spec.chunk = shape;
      spec.chunk[1] = width / inner;
      const std::int64_t row_bytes = checked_mul(element_bytes(c0.dtype), width, "chunk row bytes");
      spec.chunk[0] = std::clamp<std::int64_t>(max_chunk_bytes / row_bytes, 1, shape[0]);
      // The raw path must find every chunk (see max_raw_chunks); past that, contiguous.
      const std::int64_t chunks = (shape[0] + spec.chunk[0] - 1) / spec.chunk[0] * (whole.cols.end / width);
      if (chunks > max_raw_chunks) spec.chunk.clear();
    }
    std::sort(spec.slabs.begin(), spec.slabs.end(), [](const Slab& a, const Slab& b) {
      return a.box.rows.begin != b.box.rows.begin ? a.box.rows.begin < b.box.rows.begin
                                                  : a.box.cols.begin < b.box.cols.begin;
    });
    out.push_back(std::move(spec));
  }
  return out;
}

}  // namespace shardckpt
