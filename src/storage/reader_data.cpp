module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>  // Guarded's lock, instantiated here
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;
import :raw;
import :records;
import :seal;
import :reader_state;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using hdf5::check;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;

}  // namespace

const std::vector<RawRegion>& ReaderState::regions_for(const Entry& e) const {
  return e.regions.get([&] { return find_regions(e); });
}

const ReaderState::Entry::SlabTable& ReaderState::slabs_for(const Entry& e) const {
  return e.slabs.get([&] { return read_slab_table(e); });
}

// Where the dataset's bytes lie: each region inside its file, or the file is refused.
std::vector<RawRegion> ReaderState::find_regions(const Entry& e) const {
  const Dataset& d = *e.info;
  std::vector<RawRegion> extents;
  std::uint64_t size = file_size;
  std::string_view where = "the file";
  if (e.external) {
    size = raw->external(*e.external).file.size();
    where = *e.external;
    if (!whole_box(d.shape).empty()) extents.push_back({whole_box(d.shape), e.external_offset});
  } else {
    const Where dw{path, d.key, "locate the dataset's data"};
    Hid set = owned(H5Dopen2(h5.get(), d.key.c_str(), H5P_DEFAULT), H5Dclose, dw, Errc::not_a_checkpoint);
    Hid type = owned(H5Dget_type(set.get()), H5Tclose, dw, Errc::not_a_checkpoint);
    extents = raw_regions_of(set.get(), type.get(), d.shape, d.dtype, dw);
  }
  for (const RawRegion& x : extents) {
    const auto bytes = static_cast<std::uint64_t>(region_elements(x)) * dtype_size(d.dtype);
    if (x.address > size || bytes > size - x.address)
      refuse(cat("dataset ", d.key, " ends at byte ", x.address + bytes, " but ", where, " has ", size,
                 " (truncated)"));
  }
  return extents;
}

// The dataset's slabs (which checksums describe which rows), each inside the dataset and the
// checksum table, together covering the dataset exactly once.
ReaderState::Entry::SlabTable ReaderState::read_slab_table(const Entry& e) const {
  const Dataset& d = *e.info;
  const Box whole = whole_box(d.shape);
  std::vector<Slab> slabs;
  if (checksummed && !whole.empty()) {
    const Where w{path, d.key, "read the slab table"};
    const Errc no = Errc::not_a_checkpoint;
    Hid group = owned(H5Gopen2(h5.get(), slabs_group, H5P_DEFAULT), H5Gclose, w, no);
    if (!hdf5::has_attr(group.get(), d.key.c_str(), w))
      refuse(cat("dataset ", d.key, " has no slab table in /_shardckpt/slabs, so its bytes cannot be checked"));
    const std::vector<std::int64_t> table = hdf5::read_ints(group.get(), d.key.c_str(), 5, max_slab_values, w, no);
    std::vector<OwnedBox> boxes;
    boxes.reserve(table.size() / 5);
    slabs.reserve(table.size() / 5);
    for (std::size_t i = 0; i < table.size(); i += 5) {
      const Slab s{{{table[i], table[i + 1]}, {table[i + 2], table[i + 3]}}, table[i + 4]};
      const bool inside = s.box.rows.begin >= 0 && s.box.rows.begin < s.box.rows.end &&
                          s.box.rows.end <= whole.rows.end && s.box.cols.begin >= 0 &&
                          s.box.cols.begin < s.box.cols.end && s.box.cols.end <= whole.cols.end;
      if (!inside || s.first_checksum < 0 || s.first_checksum > checksum_count - s.box.rows.size())
        refuse(cat("slab ", i / 5, " of dataset ", d.key, " lies outside the dataset or the checksum table"));
      boxes.push_back({s.box, static_cast<std::int64_t>(i / 5)});
      slabs.push_back(s);
    }
    const std::vector<std::string> problems = tiling_problems(d.key, boxes, whole, "slab", 4);
    if (!problems.empty()) refuse(cat("its slab table does not cover dataset ", d.key, " exactly once: ", problems[0]));
    std::sort(slabs.begin(), slabs.end(), [](const Slab& a, const Slab& b) {
      return a.box.rows.begin != b.box.rows.begin ? a.box.rows.begin < b.box.rows.begin
                                                  : a.box.cols.begin < b.box.cols.begin;
    });
  }
  Entry::SlabTable out{std::move(slabs), {}};
  std::int64_t reach = 0;
  out.reach.reserve(out.slabs.size());
  for (const Slab& s : out.slabs) out.reach.push_back(reach = std::max(reach, s.box.rows.end));
  return out;
}

void ReaderState::read_checksums(std::int64_t first, std::int64_t n, std::uint64_t* out) const {
  if (n == 0) return;
  if (checksums_address) {
    file.pread_all(out, static_cast<std::size_t>(n) * sizeof(std::uint64_t),
                   *checksums_address + static_cast<std::uint64_t>(first) * sizeof(std::uint64_t));
    return;
  }
  hdf5::read_box(checksums.get(), DType::u64, std::vector<std::int64_t>{checksum_count}, {{first, first + n}, {0, 1}}, out,
                 1, 0, {path, checksums_set, "read checksums"});
}

const RawSource::External& RawSource::external(const std::string& name) const {
  const auto held = externals_.lock();
  const auto it = held->find(name);
  if (it != held->end()) return it->second;
  io::File f = dir_.open_regular(name, Errc::not_a_checkpoint);
  External& out = held->try_emplace(name).first->second;
  out.file = std::move(f);
  out.bulk.emplace(out.file, io::PageCache::use);
  return out;
}

void RawSource::read(const Dataset& d, const DatasetEntry& e, std::span<const RawRegion> regions, const Box& box,
                     std::byte* mem, std::int64_t mem_row_elems, std::int64_t mem_col,
                     const ReadOptions& options) const {
  const std::int64_t es = element_bytes(d.dtype);
  const io::File* from = &file_;
  const io::BulkReader* bulk = &cached_;
  if (e.external) {
    const External& x = external(*e.external);
    from = &x.file;
    bulk = &*x.bulk;
  } else if (options.bypass_page_cache) {
    bulk = uncached_.get([&] { return std::make_unique<io::BulkReader>(file_, io::PageCache::bypass); }).get();
  }
  const std::int64_t stride = mem_row_elems * es;
  transfer(path_, regions, es, box, mem + mem_col * es, stride,
           [&](std::byte* q, std::size_t run, std::size_t rows, std::uint64_t at, std::int64_t file_stride) {
             const auto s = static_cast<std::size_t>(stride);
             if (static_cast<std::int64_t>(run) != file_stride)  // part of each file row: few bytes, scattered
               for (std::size_t r = 0; r < rows; ++r)
                 from->pread_all(q + r * s, run, at + r * static_cast<std::uint64_t>(file_stride));
             else if (run == s)
               bulk->read(q, run * rows, at);
             else
               bulk->read_runs(q, run, s, rows, at);
           });
}

void Hdf5Source::read(const Dataset& d, const Box& box, std::byte* mem, std::int64_t mem_row_elems,
                      std::int64_t mem_col) const {
  const Where w{path_, d.key, "read a piece"};
  Hid set = owned(H5Dopen2(h5_, d.key.c_str(), H5P_DEFAULT), H5Dclose, w, Errc::not_a_checkpoint);
  hdf5::read_box(set.get(), d.dtype, d.shape, box, mem, mem_row_elems, mem_col, w);
}

// The strategy, chosen in this one place: bytes in an external file always by address (HDF5 would
// open the file by name), others by address when asked and addressable, else through HDF5.
void ReaderState::read_unchecked(const Dataset& d, const Entry& e, const Box& box, std::byte* mem,
                                 std::int64_t mem_row_elems, std::int64_t mem_col, const ReadOptions& options) const {
  if (e.external || options.method == IoMethod::raw) {
    const std::vector<RawRegion>& regions = regions_for(e);
    if (e.external || !regions.empty()) return raw->read(d, e, regions, box, mem, mem_row_elems, mem_col, options);
  }
  hdf5->read(d, box, mem, mem_row_elems, mem_col);
}

// Reads `sub` (the part of `box` that slab `s` holds) into `out` (the rows of `box`), checking
// every row read against its checksum in batches. Whole rows (the slab's rows lie inside the box's
// columns) are read in place; rows that reach past the box are read whole into scratch memory,
// checked, and the asked-for part copied.
void ReaderState::read_checked(const Dataset& d, const Entry& e, const Slab& s, const Box& sub, const Box& box,
                               std::byte* out, const ReadOptions& options) const {
  const std::int64_t es = element_bytes(d.dtype), width = box.cols.size();
  const auto mismatch = [&](std::int64_t row) {
    throw Error(Errc::corrupt, cat(path.string(), ": key ", d.key, ", ",
                                   rows_text({{row, row + 1}, s.box.cols}, whole_box(d.shape)),
                                   ": the bytes read differ from the bytes saved (checksum mismatch)"));
  };
  const bool whole_units = box.cols.begin <= s.box.cols.begin && s.box.cols.end <= box.cols.end;
  const std::int64_t unit_bytes = s.box.cols.size() * es;
  const std::int64_t step = batch_rows(whole_units ? width * es : unit_bytes,
                                       options.bypass_page_cache ? direct_read_batch : cached_read_batch);
  std::vector<std::uint64_t> want;
  std::vector<std::byte> scratch;
  for (std::int64_t r0 = sub.rows.begin; r0 < sub.rows.end; r0 += step) {
    const std::int64_t r1 = std::min(r0 + step, sub.rows.end), n = r1 - r0;
    want.resize(static_cast<std::size_t>(n));
    read_checksums(s.first_checksum + (r0 - s.box.rows.begin), n, want.data());
    std::byte* rows = out + (r0 - box.rows.begin) * width * es;
    if (whole_units) {
      read_unchecked(d, e, {{r0, r1}, s.box.cols}, rows, width, s.box.cols.begin - box.cols.begin, options);
      for (std::int64_t r = 0; r < n; ++r)
        if (row_hash(rows + (r * width + s.box.cols.begin - box.cols.begin) * es,
                     static_cast<std::size_t>(unit_bytes)) != want[static_cast<std::size_t>(r)])
          mismatch(r0 + r);
    } else {
      scratch.resize(static_cast<std::size_t>(n * unit_bytes));
      read_unchecked(d, e, {{r0, r1}, s.box.cols}, scratch.data(), s.box.cols.size(), 0, options);
      for (std::int64_t r = 0; r < n; ++r) {
        const std::byte* unit = scratch.data() + r * unit_bytes;
        if (row_hash(unit, static_cast<std::size_t>(unit_bytes)) != want[static_cast<std::size_t>(r)]) mismatch(r0 + r);
        std::memcpy(rows + r * width * es + (sub.cols.begin - box.cols.begin) * es,
                    unit + (sub.cols.begin - s.box.cols.begin) * es, static_cast<std::size_t>(sub.cols.size() * es));
      }
    }
    if (options.progress) options.progress(n * sub.cols.size() * es);
  }
}

void CheckpointReader::read(const Dataset& d, const Box& box, MutTensorView dst, ReadOptions options) const {
  const ReaderState& m = *impl_;
  check_box(d, box, dst.dtype(), dst.bytes(), m.path);
  if (box.empty()) return;
  auto* out = static_cast<std::byte*>(static_cast<void*>(dst.data()));
  const std::int64_t es = element_bytes(d.dtype), width = box.cols.size();
  const ReaderState::Entry& e = m.tensor_entry(d.key);
  if (!options.verify || !m.checksummed) {
    m.read_unchecked(d, e, box, out, width, 0, options);
    if (options.progress) options.progress(box_elements(box) * es);
    return;
  }
  std::int64_t covered = 0;
  // The slabs that can meet the box: those starting before its end whose reach passes its start.
  const ReaderState::Entry::SlabTable& table = m.slabs_for(e);
  const std::vector<Slab>& slabs = table.slabs;
  const auto first = std::upper_bound(table.reach.begin(), table.reach.end(), box.rows.begin) - table.reach.begin();
  for (auto i = static_cast<std::size_t>(first); i < slabs.size() && slabs[i].box.rows.begin < box.rows.end; ++i) {
    const Slab& s = slabs[i];
    const Box sub = s.box.intersect(box);
    if (sub.empty()) continue;
    covered += box_elements(sub);
    m.read_checked(d, e, s, sub, box, out, options);
  }
  require(covered == box_elements(box), Errc::not_a_checkpoint, m.path.string(), ": the slab table of ", d.key,
          " does not cover ", rows_text(box, whole_box(d.shape)));
}

void CheckpointReader::read(const Dataset& d, std::span<const std::int64_t> offset,
                            std::span<const std::int64_t> count, MutTensorView dst, ReadOptions options) const {
  read(d, box_of(d, offset, count), dst, options);
}



}  // namespace shardckpt
