// shardckpt.layout: slabs and boxes of datasets, balanced shares, flat parts, and the claims check
// (validate_claims).
module;
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <range/v3/view/exclusive_scan.hpp>
#include <range/v3/view/transform.hpp>
#include <range/v3/view/zip.hpp>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module shardckpt.layout;

namespace shardckpt {

namespace {
// Throws unless the slab lies inside its dataset (same rank, every dim in range).
void require_inside(std::string_view key, std::span<const std::int64_t> shape, std::span<const std::int64_t> offset,
                    std::span<const std::int64_t> count) {
  const std::size_t rank = shape.size();
  require(offset.size() == rank && count.size() == rank, Errc::invalid_argument, key,
          ": a slab whose offset/count do not match the dataset's rank ", rank);
  (void)element_count(shape, cat(key, ": elements of the global shape"));
  for (std::size_t d = 0; d < rank; ++d)
    require(offset[d] >= 0 && count[d] >= 0 && offset[d] <= shape[d] && count[d] <= shape[d] - offset[d],
            Errc::invalid_argument, key, ": [", offset[d], ", ", offset[d] + count[d], ") of dim ", d,
            " is outside its size ", shape[d]);
}
}  // namespace

bool splits_past_dim1(std::span<const std::int64_t> shape, std::span<const std::int64_t> offset,
                      std::span<const std::int64_t> count) {
  for (std::size_t d = 2; d < shape.size() && d < offset.size() && d < count.size(); ++d)
    if (offset[d] != 0 || count[d] != shape[d]) return true;
  return false;
}

std::vector<SlabPart> slab_parts(std::string_view key, std::span<const std::int64_t> shape,
                                 std::span<const std::int64_t> offset, std::span<const std::int64_t> count) {
  require_inside(key, shape, offset, count);
  const std::size_t rank = shape.size();
  std::vector<SlabPart> out;
  if (rank == 0 || element_count(count, cat(key, ": elements of the slab")) == 0) return out;
  std::size_t last = 0;  // the last split dim
  for (std::size_t d = 0; d < rank; ++d)
    if (offset[d] != 0 || count[d] != shape[d]) last = d;
  require(last >= 2, Errc::internal, key, ": slab_parts of a slab that splits only dims 0 and 1 (its footprint is one box)");
  // A part: one row of dim 0 by one index of each of dims 1..last-1, dims last.. as one run.
  const std::int64_t inner = element_count(shape.subspan(last + 1));  // elements of one index of `last`
  const std::int64_t run = count[last] * inner;
  std::int64_t parts = count[0];
  for (std::size_t d = 1; d < last; ++d) parts = checked_mul(parts, count[d], cat(key, ": parts of the slab"));
  require(parts <= max_slab_parts, Errc::invalid_argument, key, ": a slab of ", parts,
          " separate runs of elements (it splits dim ", last, " of ", dims_text(shape),
          "); at most ", max_slab_parts, " are saved or loaded");
  out.reserve(static_cast<std::size_t>(parts));
  std::vector<std::int64_t> index(last - 1, 0);  // of dims 1..last-1, within the slab
  const std::int64_t per_row = parts / std::max<std::int64_t>(count[0], 1);
  for (std::int64_t r = 0; r < count[0]; ++r) {
    std::fill(index.begin(), index.end(), 0);
    for (std::int64_t p = 0; p < per_row; ++p) {
      // Where the run starts in the dataset's row: dims 1..last in C order.
      std::int64_t at = 0;
      for (std::size_t d = 1; d < last; ++d) at = at * shape[d] + offset[d] + index[d - 1];
      at = (at * shape[last] + offset[last]) * inner;
      out.push_back({{{offset[0] + r, offset[0] + r + 1}, {at, at + run}}, r, (r * per_row + p) * run});
      for (std::size_t d = last; d-- > 1;) {  // the next index of dims 1..last-1, last fastest
        if (++index[d - 1] < count[d]) break;
        index[d - 1] = 0;
      }
    }
  }
  return out;
}

Box footprint(std::string_view key, std::span<const std::int64_t> shape, std::span<const std::int64_t> offset,
              std::span<const std::int64_t> count) {
  const std::size_t rank = shape.size();
  require_inside(key, shape, offset, count);
  if (rank == 0) return whole_box(shape);  // a scalar: its one element, one row of one
  for (std::size_t d = 2; d < rank; ++d)
    require(offset[d] == 0 && count[d] == shape[d], Errc::invalid_argument, key, ": a slab splits dim ", d,
            "; only dims 0 and 1 may be split");
  Box box{{offset[0], offset[0] + count[0]}, {0, 1}};
  if (rank >= 2) {
    const std::int64_t inner = element_count(shape.subspan(2));
    // In range: the offset and count lie inside a shape whose element count fits.
    box.cols = {offset[1] * inner, (offset[1] + count[1]) * inner};
  }
  return box;
}

Range balanced_share(std::int64_t n, std::int64_t count, std::int64_t index) {
  require(n >= 0 && count >= 1 && index >= 0 && index < count, Errc::invalid_argument, "share ", index, " of ", count,
          " of ", n);
  // n * index / count without overflow: n = q * count + r.
  const std::int64_t q = n / count, r = n % count;
  const auto start = [&](std::int64_t i) { return q * i + std::min(i, r); };
  return {start(index), start(index + 1)};
}

std::vector<FlatPart> flat_parts(const Piece& piece, std::int64_t row_elems, Range range) {
  const Box box = footprint(piece.key, piece.global_shape, piece.global_offset, piece.count);
  const std::int64_t c = row_elems;
  const Range elems =
      Range{piece.shard_row * c, (piece.shard_row + piece.rows) * c}.intersect(range);
  std::vector<FlatPart> out;
  if (elems.empty()) return out;
  // Shard row r, elements [lo, hi) of it, as a box of the dataset.
  const auto part = [&](std::int64_t r, std::int64_t rows, std::int64_t lo, std::int64_t hi, std::int64_t first) {
    const std::int64_t row = box.rows.begin + r - piece.shard_row;
    out.push_back({{{row, row + rows}, {box.cols.begin + lo, box.cols.begin + hi}}, first - range.begin});
  };
  std::int64_t a = elems.begin;
  const std::int64_t b = elems.end;
  if (a / c == (b - 1) / c) {
    part(a / c, 1, a % c, b - a / c * c, a);
    return out;
  }
  if (a % c != 0) {
    part(a / c, 1, a % c, c, a);
    a = (a / c + 1) * c;
  }
  if (b / c > a / c) part(a / c, b / c - a / c, 0, c, a);
  if (b % c != 0) part(b / c, 1, 0, b % c, b / c * c);
  return out;
}

Box whole_box(std::span<const std::int64_t> shape) {
  if (shape.empty()) return {{0, 1}, {0, 1}};
  return {{0, shape[0]}, {0, element_count(shape.subspan(1), "elements of a row")}};
}

std::int64_t box_elements(const Box& box) {
  return box.empty() ? 0 : checked_mul(box.rows.size(), box.cols.size(), "elements of a slab");
}

namespace {

// True when no two boxes share an element: a sweep over rows keeps the column ranges of the boxes
// that span the current row, which must stay disjoint.
bool disjoint(std::span<const OwnedBox> boxes) {
  struct Event {
    std::int64_t row;
    bool insert;
    std::size_t box;
  };
  std::vector<Event> events;
  events.reserve(boxes.size() * 2);
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    events.push_back({boxes[i].box.rows.begin, true, i});
    events.push_back({boxes[i].box.rows.end, false, i});
  }
  // At the same row, boxes that end leave before boxes that begin arrive.
  std::sort(events.begin(), events.end(),
            [](const Event& a, const Event& b) { return a.row != b.row ? a.row < b.row : a.insert < b.insert; });
  std::map<std::int64_t, std::int64_t> active;  // column begin -> column end
  for (const Event& e : events) {
    const Range cols = boxes[e.box].box.cols;
    if (!e.insert) {
      active.erase(cols.begin);
      continue;
    }
    const auto next = active.lower_bound(cols.begin);
    if (next != active.end() && next->first < cols.end) return false;
    if (next != active.begin() && std::prev(next)->second > cols.begin) return false;
    active.emplace(cols.begin, cols.end);
  }
  return true;
}

}  // namespace

std::vector<std::string> tiling_problems(std::string_view key, std::span<const OwnedBox> boxes, const Box& whole,
                                         std::string_view owner_noun, std::size_t limit) {
  std::int64_t area = 0;
  for (const OwnedBox& o : boxes) area = checked_add(area, box_elements(o.box), "elements of all slabs");
  if (area == box_elements(whole) && disjoint(boxes)) return {};

  // Something is wrong: find what, band by band. Between two consecutive column cuts every box
  // either covers the whole band or none of it, so each band reduces to a 1-D check of row ranges.
  std::vector<std::string> problems;
  auto report = [&](std::string text) {
    if (problems.size() < limit) problems.push_back(std::move(text));
  };
  std::set<std::int64_t> cuts{whole.cols.begin, whole.cols.end};
  for (const OwnedBox& o : boxes) {
    cuts.insert(o.box.cols.begin);
    cuts.insert(o.box.cols.end);
  }
  for (auto it = cuts.begin(); std::next(it) != cuts.end() && problems.size() < limit; ++it) {
    const Range band{*it, *std::next(it)};
    std::vector<const OwnedBox*> in_band;
    for (const OwnedBox& o : boxes)
      if (o.box.cols.begin <= band.begin && band.end <= o.box.cols.end) in_band.push_back(&o);
    std::sort(in_band.begin(), in_band.end(),
              [](const OwnedBox* a, const OwnedBox* b) { return a->box.rows.begin < b->box.rows.begin; });
    std::int64_t cursor = whole.rows.begin;
    const OwnedBox* prev = nullptr;
    const std::string where =
        whole.cols == band ? std::string() : cat(" (elements [", band.begin, ", ", band.end, ") of each row)");
    for (const OwnedBox* o : in_band) {
      if (o->box.rows.begin > cursor)
        report(cat("key ", key, ": rows [", cursor, ", ", o->box.rows.begin, ")", where, " are saved by no ",
                   owner_noun));
      else if (o->box.rows.begin < cursor)
        report(cat("key ", key, ": rows [", o->box.rows.begin, ", ", std::min(cursor, o->box.rows.end), ")", where,
                   " are saved by both ", owner_noun, " ", prev->owner, " and ", owner_noun, " ", o->owner));
      if (o->box.rows.end > cursor) {
        cursor = o->box.rows.end;
        prev = o;
      }
    }
    if (cursor < whole.rows.end)
      report(cat("key ", key, ": rows [", cursor, ", ", whole.rows.end, ")", where, " are saved by no ", owner_noun));
  }
  if (problems.empty()) problems.push_back(cat("key ", key, ": the slabs cover ", area, " of ", box_elements(whole),
                                               " elements"));
  return problems;
}

void validate_claims(std::span<const Claim> claims) {
  std::map<std::string_view, std::vector<const Claim*>> by_key;
  for (const Claim& c : claims) by_key[c.key].push_back(&c);

  std::vector<std::string> problems;
  for (const auto& [key, list] : by_key) {
    const Claim& first = *list.front();
    for (const Claim* c : list) {
      require(c->dtype == first.dtype, Errc::dtype_mismatch, "key ", key, ": rank ", first.rank, " saves ",
              dtype_name(first.dtype), " but rank ", c->rank, " saves ", dtype_name(c->dtype));
      require(c->global_shape == first.global_shape, Errc::shape_mismatch, "key ", key, ": ranks ", first.rank, " and ",
              c->rank, " disagree on the global shape");
    }
    const Box whole = whole_box(first.global_shape);
    std::vector<OwnedBox> boxes;
    for (const Claim* c : list) {
      const Box& b = c->box;
      require(b.rows.begin >= 0 && b.rows.begin <= b.rows.end && b.rows.end <= whole.rows.end && b.cols.begin >= 0 &&
                  b.cols.begin <= b.cols.end && b.cols.end <= whole.cols.end,
              Errc::invalid_argument, "key ", key, ": rank ", c->rank, " claims rows [", b.rows.begin, ", ",
              b.rows.end, ") and elements [", b.cols.begin, ", ", b.cols.end, ") of a dataset of ",
              dims_text(first.global_shape));
      if (c->writes && !b.empty()) boxes.push_back({b, c->rank});
    }
    for (std::string& p : tiling_problems(key, boxes, whole, "rank", 16 - problems.size()))
      problems.push_back(std::move(p));
    if (problems.size() >= 16) break;
  }
  if (!problems.empty()) {
    std::string text = "pieces do not tile the checkpoint exactly once";
    for (const std::string& p : problems) text += "\n  " + p;
    throw Error(Errc::tiling, std::move(text));
  }
}

}  // namespace shardckpt
