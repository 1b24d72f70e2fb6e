module;
#include <hdf5.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.format;
import shardckpt.hdf5;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using hdf5::check;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;

// Checksums are over the bytes as stored (little-endian), and the direct path moves bytes as they
// lie in memory: both need a little-endian host.
static_assert(std::endian::native == std::endian::little, "shardckpt needs a little-endian host");

constexpr const char* meta_group = "_shardckpt";
constexpr const char* common_group = "_shardckpt/common";
constexpr const char* slabs_group = "_shardckpt/slabs";
constexpr const char* checksums_set = "_shardckpt/checksums";
// The checksum scheme, recorded so that a future one is refused rather than misread.
constexpr std::string_view checksum_scheme = "xxh3-64 of each row of each slab";
constexpr std::string_view no_checksums = "none";

// Rows are written (and checked rows read) in batches of about this many bytes: small enough that a
// batch is still in cache when it is checksummed, large enough that calls are few.
constexpr std::int64_t batch_bytes = std::int64_t{1} << 20;
// Checked reads through the page cache hash each batch right after the kernel copied it: a quarter
// of the above keeps it in a core's L2 (a load checking 1 MiB batches ran 10-20% slower than one
// checking nothing). Direct reads land in memory, not in a cache, and want fewer, larger reads.
constexpr std::int64_t cached_read_batch = std::int64_t{256} << 10, direct_read_batch = batch_bytes;
// Chunks of at most this many bytes (HDF5 caps a chunk at 4 GiB).
constexpr std::int64_t max_chunk_bytes = std::int64_t{1} << 30;
// Chunk lists longer than this (small chunks written by other tools) are read through HDF5: HDF5
// 1.10 finds one chunk's address in time linear in the chunks, so listing n costs n^2 (a dataset
// of 100,000 chunks took 75 s). A save chunks a dataset one TP band wide: far fewer chunks.
constexpr std::int64_t max_direct_chunks = 4096;
// Slabs in one dataset's table (5 values each) a reader accepts.
constexpr std::size_t max_slab_values = std::size_t{5} << 24;

std::uint64_t row_hash(const void* bytes, std::size_t n) noexcept { return XXH3_64bits(bytes, n); }

std::string rows_text(const Box& box, const Box& whole) {
  return cat("rows [", box.rows.begin, ", ", box.rows.end, ")",
             box.cols == whole.cols ? std::string()
                                    : cat(" (elements [", box.cols.begin, ", ", box.cols.end, ") of each row)"));
}

void require_key(std::string_view key) {
  require(!key.empty() && key.find('/') == std::string_view::npos && key != "." && key[0] != '_',
          Errc::invalid_argument, "key '", key,
          "' cannot name a dataset: it must be non-empty, contain no '/' and not start with '_'");
}

// ---- parameter records -------------------------------------------------------------------------------

json params_json(const std::vector<ParamRecord>& params) {
  json out = json::array();
  for (const ParamRecord& p : params) {
    json blocks = json::array();
    for (const Section& s : p.blocks) blocks.push_back({{"name", s.name}, {"rows", s.rows}});
    out.push_back({{"key", p.key}, {"tp_axis", tp_axis_name(p.tp_axis)}, {"blocks", blocks}, {"trailing", p.trailing}});
  }
  return out;
}

// Strict: every field present with its JSON type, integers in the int64 range, nothing nested
// deeper than records need; then each record is planned once, which checks its geometry.
std::vector<ParamRecord> params_from_json(std::string_view text) {
  bool too_deep = false;
  const json in = json::parse(
      text,
      [&](int depth, json::parse_event_t, json&) {
        if (depth > 4) too_deep = true;
        return !too_deep;
      },
      true);
  if (too_deep) throw std::invalid_argument("nested deeper than parameter records are");
  if (!in.is_array()) throw std::invalid_argument("not a JSON array");
  const auto integer = [](const json& v, std::string_view what) {
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw std::invalid_argument(cat(what, " ", u, " is past the int64 range"));
      return static_cast<std::int64_t>(u);
    }
    if (!v.is_number_integer()) throw std::invalid_argument(cat(what, " is not an integer"));
    return v.get<std::int64_t>();
  };
  const auto string = [](const json& v, std::string_view what) {
    if (!v.is_string()) throw std::invalid_argument(cat(what, " is not a string"));
    return v.get<std::string>();
  };
  std::vector<ParamRecord> out;
  std::set<std::string> keys;
  for (const json& p : in) {
    if (!p.is_object() || !p.contains("key") || !p.contains("tp_axis") || !p.contains("blocks") ||
        !p.contains("trailing"))
      throw std::invalid_argument("a record is not an object with key, tp_axis, blocks and trailing");
    ParamRecord r;
    r.key = string(p["key"], "a record's key");
    r.tp_axis = parse_tp_axis(string(p["tp_axis"], cat(r.key, ": tp_axis")));
    if (!p["blocks"].is_array() || !p["trailing"].is_array())
      throw std::invalid_argument(cat(r.key, ": blocks and trailing must be arrays"));
    for (const json& b : p["blocks"]) {
      if (!b.is_object() || !b.contains("name") || !b.contains("rows"))
        throw std::invalid_argument(cat(r.key, ": a block is not an object with name and rows"));
      r.blocks.push_back({string(b["name"], cat(r.key, ": a block name")), integer(b["rows"], cat(r.key, ": rows"))});
    }
    for (const json& t : p["trailing"]) r.trailing.push_back(integer(t, cat(r.key, ": a trailing dim")));
    if (!keys.insert(r.key).second) throw std::invalid_argument(cat("parameter ", r.key, " is recorded twice"));
    (void)spec_at_tp(r, 1);  // non-empty blocks, positive sizes, unique names, no overflow
    out.push_back(std::move(r));
  }
  return out;
}

// ---- raw data addresses and positional transfers -----------------------------------------------------

// Where the raw data of an open dataset lies, when the direct path may use it: stored unfiltered in
// exactly the library's type, allocated in full, split (if chunked) along dims 0 and 1 only.
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
  std::int64_t inner = 1;
  for (std::size_t d = 2; d < rank; ++d) {
    if (static_cast<std::int64_t>(dims[d]) != shape[d]) return {};
    inner *= shape[d];
  }
  for (hsize_t d : dims)
    if (d == 0 || d > static_cast<hsize_t>(std::numeric_limits<std::int32_t>::max())) return {};
  const auto chunk_rows = static_cast<std::int64_t>(dims[0]);
  const std::int64_t chunk_dim1 = rank > 1 ? static_cast<std::int64_t>(dims[1]) : 1;
  const std::int64_t chunk_cols = chunk_dim1 * inner;
  const std::int64_t row_chunks = (shape[0] + chunk_rows - 1) / chunk_rows;
  const std::int64_t col_chunks = rank > 1 ? (shape[1] + chunk_dim1 - 1) / chunk_dim1 : 1;
  if (row_chunks > max_direct_chunks || col_chunks > max_direct_chunks / std::max<std::int64_t>(row_chunks, 1))
    return {};
  const std::int64_t chunk_bytes =
      checked_mul(checked_mul(chunk_rows, chunk_cols, "chunk size", Errc::not_a_checkpoint), element_bytes(dtype),
                  "chunk size", Errc::not_a_checkpoint);
  std::vector<RawRegion> out;
  std::vector<hsize_t> offset(rank, 0);
  for (std::int64_t rc = 0; rc < row_chunks; ++rc)
    for (std::int64_t cc = 0; cc < col_chunks; ++cc) {
      offset[0] = static_cast<hsize_t>(rc * chunk_rows);
      if (rank > 1) offset[1] = static_cast<hsize_t>(cc * chunk_dim1);
      unsigned filters = 0;
      haddr_t addr = HADDR_UNDEF;
      hsize_t size = 0;
      if (H5Dget_chunk_info_by_coord(set, offset.data(), &filters, &addr, &size) < 0 || addr == HADDR_UNDEF ||
          size != static_cast<hsize_t>(chunk_bytes)) {
        H5Eclear2(H5E_DEFAULT);  // chunks never written are not allocated: part of the data has no address
        return {};
      }
      const std::int64_t row = rc * chunk_rows, col = cc * chunk_cols;
      out.push_back({{{row, row + chunk_rows}, {col, col + chunk_cols}}, addr});
    }
  return out;
}

// Moves `box` (a box of one dataset) between the file and memory, where memory row i of the box
// starts at mem + i * mem_stride bytes. For each extent the box meets, `move(p, run, rows, at,
// file_stride)` moves `rows` rows of `run` bytes: file row i at at + i * file_stride, memory row i
// at p + i * mem_stride.
template <class Mem, class Move>
void transfer(const fs::path& file, std::span<const RawRegion> extents, std::int64_t es, const Box& box, Mem* mem,
              std::int64_t mem_stride, Move&& move) {
  std::int64_t moved = 0;
  for (const RawRegion& e : extents) {
    const Box hit = box.intersect(e.box);
    if (hit.empty()) continue;
    moved += box_elements(hit);
    const std::int64_t file_stride = e.box.cols.size() * es, run = hit.cols.size() * es;
    const std::uint64_t at =
        e.address +
        static_cast<std::uint64_t>(
            ((hit.rows.begin - e.box.rows.begin) * e.box.cols.size() + hit.cols.begin - e.box.cols.begin) * es);
    move(mem + (hit.rows.begin - box.rows.begin) * mem_stride + (hit.cols.begin - box.cols.begin) * es,
         static_cast<std::size_t>(run), static_cast<std::size_t>(hit.rows.size()), at, file_stride);
  }
  require(moved == box_elements(box), Errc::not_a_checkpoint, file.string(),
          ": the dataset's chunks do not cover the slab being moved");
}

// Rows per batch of about `batch` bytes for rows of `row_bytes`.
std::int64_t batch_rows(std::int64_t row_bytes, std::int64_t batch = batch_bytes) {
  return std::max<std::int64_t>(1, batch / std::max<std::int64_t>(row_bytes, 1));
}

// Checks a box against a dataset and the caller's tensor.
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

Box box_of(const Dataset& d, std::span<const std::int64_t> offset, std::span<const std::int64_t> count) {
  return footprint(d.key, d.shape, offset, count);
}

Hid create_dataset(hid_t file, const Dataset& d, const Where& w) {
  Hid dcpl = owned(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, w);
  if (d.external) {
    require(io::plain_name(d.external->file), Errc::invalid_argument, "dataset ", d.key, ": external file '",
            d.external->file, "' is not a plain file name");
    const auto bytes = static_cast<hsize_t>(element_count(d.shape)) * dtype_size(d.dtype);
    check(H5Pset_external(dcpl.get(), d.external->file.c_str(), static_cast<off_t>(d.external->offset), bytes), w);
  } else if (d.chunk.empty()) {
    check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), w);
  } else {
    const std::vector<hsize_t> chunk(d.chunk.begin(), d.chunk.end());
    check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()), w);
  }
  // Allocated now and never filled: every byte has a fixed file address before any rank writes,
  // and HDF5 spends no time writing fill values that pieces overwrite.
  if (!d.external) check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), w);
  check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), w);
  const std::vector<hsize_t> dims(d.shape.begin(), d.shape.end());
  Hid space = owned(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose, w);
  Hid type = hdf5::type_of(d.dtype);
  return owned(H5Dcreate2(file, d.key.c_str(), type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
               H5Dclose, w);
}

// ---- the seal: checksums of the HDF5 metadata, checked before HDF5 reads any of it ------------------
//
// The trailer past HDF5's end of the file: the metadata ranges, the page table (for every 4 KiB page
// of the file that holds metadata, the XXH3-64 of its metadata bytes in file order), then the tail,
// last. The seal's digest is the XXH3-64 of the ranges and the page table: what ranks agree on. A
// reader that trusts nothing checks every page once when it opens the file; afterwards every read
// HDF5 makes is checked again against the page table before HDF5 sees its bytes, so that a file
// changed in place under a reader is an error, never bytes HDF5 parses unchecked. Files sealed by
// shardckpt 0.2 (one hash over all metadata, magic "SHCKSEAL") are checked once, at open.

// A range of bytes as the trailer stores it.
struct DiskRange {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

struct SealTail {  // "SHCKSEL2"
  std::uint64_t regions = 0;      // ByteRanges after the sealed bytes
  std::uint64_t pages = 0;        // PageHashes after the ranges
  std::uint64_t sealed_size = 0;  // the file's size without the trailer
  std::uint64_t digest = 0;       // XXH3-64 of the ranges and the page table
  std::uint64_t trailer_bytes = 0;
  std::uint64_t magic = 0;
};
struct OldSealTail {  // "SHCKSEAL"
  std::uint64_t regions = 0;
  std::uint64_t sealed_size = 0;
  std::uint64_t metadata_hash = 0;
  std::uint64_t regions_hash = 0;
  std::uint64_t trailer_bytes = 0;
  std::uint64_t magic = 0;
};
struct PageHash {
  std::uint64_t page = 0;
  std::uint64_t hash = 0;
};
constexpr std::uint64_t seal_magic = 0x324c45534b434853;      // "SHCKSEL2"
constexpr std::uint64_t old_seal_magic = 0x4c4145534b434853;  // "SHCKSEAL"
constexpr std::uint64_t seal_page = 4096;
static_assert(sizeof(SealTail) == 48 && sizeof(OldSealTail) == 48 && sizeof(DiskRange) == 16 &&
              sizeof(PageHash) == 16);

// The ranges of [0, size) that are not in `data`: what HDF5 wrote.
std::vector<DiskRange> metadata_ranges(std::span<const Range> data, std::uint64_t size) {
  std::vector<Range> sorted(data.begin(), data.end());
  std::sort(sorted.begin(), sorted.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::vector<DiskRange> out;
  std::uint64_t at = 0;
  for (const Range& d : sorted) {
    const std::uint64_t begin = std::min(static_cast<std::uint64_t>(d.begin), size),
                        end = std::min(static_cast<std::uint64_t>(d.end), size);
    if (begin > at) out.push_back({at, begin - at});
    at = std::max(at, end);
  }
  if (at < size) out.push_back({at, size - at});
  return out;
}

std::uint64_t hash_ranges(const io::File& file, std::span<const DiskRange> ranges) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  std::vector<std::byte> buffer(static_cast<std::size_t>(batch_bytes));
  for (const DiskRange& r : ranges)
    for (std::uint64_t done = 0; done < r.length;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(r.length - done, buffer.size()));
      file.pread_all(buffer.data(), n, r.offset + done);
      XXH3_64bits_update(&state, buffer.data(), n);
      done += n;
    }
  return XXH3_64bits_digest(&state);
}

// The page table of the metadata `regions` (sorted, disjoint) as the file holds them now.
std::vector<PageHash> page_hashes(const io::File& file, std::span<const DiskRange> regions) {
  std::vector<PageHash> out;
  XXH3_state_t state;
  std::optional<std::uint64_t> page;
  const auto close_page = [&] {
    if (page) out.push_back({*page, XXH3_64bits_digest(&state)});
  };
  std::vector<std::byte> buffer(static_cast<std::size_t>(batch_bytes));
  for (const DiskRange& r : regions)
    for (std::uint64_t done = 0; done < r.length;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(r.length - done, buffer.size()));
      file.pread_all(buffer.data(), n, r.offset + done);
      for (std::size_t i = 0; i < n;) {
        const std::uint64_t at = r.offset + done + i, p = at / seal_page;
        const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(n - i, (p + 1) * seal_page - at));
        if (page != p) {
          close_page();
          page = p;
          XXH3_64bits_reset(&state);
        }
        XXH3_64bits_update(&state, buffer.data() + i, take);
        i += take;
      }
      done += n;
    }
  close_page();
  return out;
}

std::uint64_t seal_digest(std::span<const DiskRange> regions, std::span<const PageHash> pages) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, regions.data(), regions.size_bytes());
  XXH3_64bits_update(&state, pages.data(), pages.size_bytes());
  return XXH3_64bits_digest(&state);
}

void write_seal(io::File& file, std::span<const Range> data) {
  const std::uint64_t size = file.size();
  const std::vector<DiskRange> regions = metadata_ranges(data, size);
  const std::vector<PageHash> pages = page_hashes(file, regions);
  const std::uint64_t list_bytes = regions.size() * sizeof(DiskRange), table_bytes = pages.size() * sizeof(PageHash);
  const SealTail tail{regions.size(),       pages.size(), size, seal_digest(regions, pages),
                      list_bytes + table_bytes + sizeof(SealTail), seal_magic};
  file.pwrite_all(regions.data(), list_bytes, size);
  file.pwrite_all(pages.data(), table_bytes, size + list_bytes);
  file.pwrite_all(&tail, sizeof tail, size + list_bytes + table_bytes);
}

}  // namespace

// The seal of an open checkpoint: the metadata ranges and the page table, which every read HDF5
// makes of the file is checked against (hdf5::ReadCheck). Reads outside the metadata (raw data,
// which row checksums cover) pass unchecked.
class SealedMetadata final : public hdf5::ReadCheck {
 public:
  SealedMetadata(std::vector<DiskRange> regions, std::vector<PageHash> pages)
      : regions_(std::move(regions)), pages_(std::move(pages)) {}

  void read(const io::File& file, std::uint64_t address, void* dst, std::size_t n) const override {
    auto* out = static_cast<std::byte*>(dst);
    const std::uint64_t end = address + n;
    std::uint64_t at = address;
    auto page = std::lower_bound(pages_.begin(), pages_.end(), at / seal_page,
                                 [](const PageHash& p, std::uint64_t i) { return p.page < i; });
    while (at < end) {
      if (page == pages_.end() || page->page > at / seal_page) {  // raw data up to the next metadata page
        const std::uint64_t to = page == pages_.end() ? end : std::min(end, page->page * seal_page);
        const auto want = static_cast<std::size_t>(to - at);
        const std::size_t got = file.pread_upto(out + (at - address), want, at);
        std::memset(out + (at - address) + got, 0, want - got);
        at = to;
        continue;
      }
      std::byte bytes[seal_page];
      const std::uint64_t first = page->page * seal_page;
      const std::size_t got = file.pread_upto(bytes, seal_page, first);
      std::memset(bytes + got, 0, seal_page - got);
      if (hash_of_page(first, bytes) != page->hash)
        throw Error(Errc::corrupt, cat(file.path().string(), ": its metadata at byte ", first,
                                       " changed after it was sealed (the file was modified in place)"));
      const std::uint64_t to = std::min(end, first + seal_page);
      std::memcpy(out + (at - address), bytes + (at - first), static_cast<std::size_t>(to - at));
      at = to;
      ++page;
    }
  }

 private:
  // The hash of the metadata bytes of the page at `first`, whose bytes are `bytes`.
  std::uint64_t hash_of_page(std::uint64_t first, const std::byte* bytes) const {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    auto r = std::upper_bound(regions_.begin(), regions_.end(), first,
                              [](std::uint64_t at, const DiskRange& x) { return at < x.offset; });
    if (r != regions_.begin()) --r;
    for (; r != regions_.end() && r->offset < first + seal_page; ++r) {
      const std::uint64_t lo = std::max(r->offset, first), hi = std::min(r->offset + r->length, first + seal_page);
      if (lo < hi) XXH3_64bits_update(&state, bytes + (lo - first), static_cast<std::size_t>(hi - lo));
    }
    return XXH3_64bits_digest(&state);
  }

  std::vector<DiskRange> regions_;
  std::vector<PageHash> pages_;
};

namespace {

// What check_seal found: the digest ranks agree on, and (a current seal) the metadata every later
// HDF5 read is checked against.
struct Seal {
  std::uint64_t digest = 0;
  std::unique_ptr<SealedMetadata> pages;
};

[[noreturn]] void damaged(const io::File& file, std::string_view why) {
  throw Error(Errc::corrupt, cat(file.path().string(), ": its metadata differs from what was saved (", why, ")"));
}

std::vector<DiskRange> checked_regions(const io::File& file, std::uint64_t count, std::uint64_t at,
                                       std::uint64_t sealed_size) {
  std::vector<DiskRange> regions(static_cast<std::size_t>(count));
  file.pread_all(regions.data(), regions.size() * sizeof(DiskRange), at);
  std::uint64_t end = 0;
  for (const DiskRange& r : regions) {
    if (r.offset < end || r.offset > sealed_size || r.length > sealed_size - r.offset)
      damaged(file, "its seal lists ranges that overlap or leave the file");
    end = r.offset + r.length;
  }
  return regions;
}

std::optional<Seal> check_old_seal(const io::File& file, const OldSealTail& tail, std::uint64_t size,
                                   std::optional<std::uint64_t> trusted) {
  if (tail.regions > size / sizeof(DiskRange) || tail.trailer_bytes != tail.regions * sizeof(DiskRange) + sizeof tail ||
      tail.trailer_bytes > size || tail.sealed_size != size - tail.trailer_bytes)
    damaged(file, "its seal does not describe the file");
  if (trusted) {
    if (*trusted != tail.metadata_hash)
      throw Error(Errc::replaced, cat(file.path().string(), " is not the checkpoint another rank opened"));
    return Seal{tail.metadata_hash, nullptr};
  }
  std::vector<DiskRange> regions(static_cast<std::size_t>(tail.regions));
  file.pread_all(regions.data(), regions.size() * sizeof(DiskRange), tail.sealed_size);
  if (row_hash(regions.data(), regions.size() * sizeof(DiskRange)) != tail.regions_hash)
    damaged(file, "its seal is damaged");
  (void)checked_regions(file, tail.regions, tail.sealed_size, tail.sealed_size);
  if (hash_ranges(file, regions) != tail.metadata_hash) damaged(file, "the seal does not match");
  return Seal{tail.metadata_hash, nullptr};
}

// The file's seal, checked, or nothing for an unsealed file. With `trusted` (the digest another rank
// checked the whole seal of), only that this file's page table is the one with that digest.
std::optional<Seal> check_seal(const io::File& file, std::optional<std::uint64_t> trusted) {
  const std::uint64_t size = file.size();
  SealTail tail;
  if (size < sizeof tail) return std::nullopt;
  file.pread_all(&tail, sizeof tail, size - sizeof tail);
  if (tail.magic == old_seal_magic) {
    OldSealTail old;
    std::memcpy(&old, &tail, sizeof old);
    return check_old_seal(file, old, size, trusted);
  }
  if (tail.magic != seal_magic) {
    if (trusted.value_or(0) != 0)
      throw Error(Errc::replaced, cat(file.path().string(), " is not the sealed checkpoint another rank opened"));
    return std::nullopt;
  }
  const std::uint64_t most = size / sizeof(DiskRange);
  if (tail.regions > most || tail.pages > most ||
      tail.trailer_bytes != (tail.regions + tail.pages) * sizeof(DiskRange) + sizeof tail ||
      tail.trailer_bytes > size || tail.sealed_size != size - tail.trailer_bytes)
    damaged(file, "its seal does not describe the file");
  std::vector<DiskRange> regions = checked_regions(file, tail.regions, tail.sealed_size, tail.sealed_size);
  std::vector<PageHash> pages(static_cast<std::size_t>(tail.pages));
  file.pread_all(pages.data(), pages.size() * sizeof(PageHash), tail.sealed_size + regions.size() * sizeof(DiskRange));
  const std::uint64_t digest = seal_digest(regions, pages);
  if (digest != tail.digest) damaged(file, "its seal is damaged");
  if (trusted && *trusted != digest)
    throw Error(Errc::replaced, cat(file.path().string(), " is not the checkpoint another rank opened"));
  if (!trusted) {
    const std::vector<PageHash> now = page_hashes(file, regions);
    if (now.size() != pages.size() ||
        !std::equal(now.begin(), now.end(), pages.begin(),
                    [](const PageHash& a, const PageHash& b) { return a.page == b.page && a.hash == b.hash; }))
      damaged(file, "the seal does not match");
  } else {
    for (std::size_t i = 0; i < pages.size(); ++i)
      if ((i > 0 && pages[i].page <= pages[i - 1].page) || pages[i].page > tail.sealed_size / seal_page)
        damaged(file, "its seal's page table is not in order");
  }
  return Seal{digest, std::make_unique<SealedMetadata>(std::move(regions), std::move(pages))};
}

}  // namespace

// ---- records, slabs and the chunking policy ------------------------------------------------------------

std::int64_t checksum_rows_of(const Box& box) { return box.empty() ? 0 : box.rows.size(); }

std::vector<Dataset> datasets_of(std::span<const Claim> claims, std::span<const std::int64_t> first_checksums) {
  require(first_checksums.size() == claims.size(), Errc::internal, "one first unit per claim");
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
      // The direct path must find every chunk (see max_direct_chunks); past that, contiguous.
      const std::int64_t chunks = (shape[0] + spec.chunk[0] - 1) / spec.chunk[0] * (whole.cols.end / width);
      if (chunks > max_direct_chunks) spec.chunk.clear();
    }
    std::sort(spec.slabs.begin(), spec.slabs.end(), [](const Slab& a, const Slab& b) {
      return a.box.rows.begin != b.box.rows.begin ? a.box.rows.begin < b.box.rows.begin
                                                  : a.box.cols.begin < b.box.cols.begin;
    });
    out.push_back(std::move(spec));
  }
  return out;
}

// ---- the writer side ----------------------------------------------------------------------------------

Skeleton create_skeleton(io::File& f, std::span<const Dataset> datasets, const CheckpointContents& contents,
                         std::int64_t checksum_rows) {
  require(checksum_rows >= 0 && (contents.checksummed || checksum_rows == 0), Errc::internal, "a checksum count of ", checksum_rows);
  const fs::path& partial = f.path();
  const Where w{partial, "", "create the checkpoint"};
  hdf5::Channel channel(f);
  Skeleton out;
  {
    Hid file = hdf5::create_file(channel);
    Hid meta = hdf5::create_group(file.get(), meta_group, w);
    hdf5::write_attr(meta.get(), "format", std::string_view("shardckpt"), w);
    hdf5::write_attr(meta.get(), "format_version", std::int64_t{format_version}, w);
    hdf5::write_attr(meta.get(), "kind",
                     std::string_view(contents.kind == CheckpointKind::global ? "global" : "local"), w);
    hdf5::write_attr(meta.get(), "checkpoint_id", std::string_view(contents.id), w);
    hdf5::write_attr(meta.get(), "checksums", contents.checksummed ? checksum_scheme : no_checksums, w);
    hdf5::write_attr(meta.get(), "params", std::string_view(params_json(contents.params).dump()), w);
    meta.close(w);
    Hid common = hdf5::create_group(file.get(), common_group, w);
    for (const auto& [key, value] : contents.common) {
      require_key(key);
      hdf5::write_attr(common.get(), key.c_str(), value, w);
    }
    common.close(w);
    if (contents.checksummed) {
      const Dataset table{checksums_set, DType::u64, {checksum_rows}};
      Hid set = create_dataset(file.get(), table, w);
      if (checksum_rows > 0) {
        const haddr_t addr = H5Dget_offset(set.get());
        require(addr != HADDR_UNDEF, Errc::hdf5, "HDF5 did not allocate the checksum table of ", partial.string());
        out.checksums_address = addr;
        const auto begin = static_cast<std::int64_t>(addr);
        out.data.push_back({begin, begin + checksum_rows * static_cast<std::int64_t>(sizeof(std::uint64_t))});
      }
      set.close(w);
    }
    Hid slabs = contents.checksummed ? hdf5::create_group(file.get(), slabs_group, w) : Hid();
    out.datasets.reserve(datasets.size());
    for (const Dataset& d : datasets) {
      require_key(d.key);
      const Where dw{partial, d.key, "create the dataset"};
      Hid set = create_dataset(file.get(), d, dw);
      if (d.placement) {
        const Box& b = d.placement->box;
        const std::int64_t box[] = {b.rows.begin, b.rows.end, b.cols.begin, b.cols.end};
        hdf5::write_attr(set.get(), "global_key", std::string_view(d.placement->key), dw);
        hdf5::write_attr(set.get(), "global_shape", std::span<const std::int64_t>(d.placement->global_shape), 0, dw);
        hdf5::write_attr(set.get(), "global_box", std::span<const std::int64_t>(box), 0, dw);
      }
      if (contents.checksummed && !d.slabs.empty()) {
        std::vector<std::int64_t> table;
        table.reserve(d.slabs.size() * 5);
        for (const Slab& s : d.slabs)
          table.insert(table.end(), {s.box.rows.begin, s.box.rows.end, s.box.cols.begin, s.box.cols.end, s.first_checksum});
        hdf5::write_attr(slabs.get(), d.key.c_str(), std::span<const std::int64_t>(table), 5, dw);
      }
      Hid type = hdf5::type_of(d.dtype);
      Dataset made{d.key, d.dtype, d.shape, d.placement};
      made.regions = raw_regions_of(set.get(), type.get(), d.shape, d.dtype, dw);
      out.datasets.push_back(std::move(made));
      for (const RawRegion& e : out.datasets.back().regions) {
        const auto begin = static_cast<std::int64_t>(e.address);
        out.data.push_back({begin, begin + box_elements(e.box) * element_bytes(d.dtype)});
      }
      set.close(dw);
    }
    if (slabs) slabs.close(w);
    hdf5::close_written(file, channel, "create the checkpoint");
  }
  f.sync();
  return out;
}

struct PieceWriter::Impl {
  explicit Impl(io::File& f) : file(f) {}
  fs::path path;
  IoMethod method = IoMethod::raw;
  std::optional<ChecksumSlot> checksums;
  io::File& file;
  std::unique_ptr<hdf5::Channel> channel;  // hyperslab path
  Hid h5;                                  // hyperslab path
  std::map<std::string, Hid, std::less<>> sets;
  std::vector<std::uint64_t> hashes;  // not yet in the table
  std::int64_t hashes_written = 0;    // checksums of this writer already in the table
  BytesDone progress;

  // The checksums computed so far go to their place in the table: a writer holds at most
  // hash_batch of them, whatever the number of rows it writes.
  static constexpr std::size_t hash_batch = 8192;
  void flush_hashes();

  hid_t dataset(const std::string& key, const Where& w) {
    auto it = sets.find(key);
    if (it == sets.end()) it = sets.emplace(key, owned(H5Dopen2(h5.get(), key.c_str(), H5P_DEFAULT), H5Dclose, w)).first;
    return it->second.get();
  }
};

PieceWriter::PieceWriter(io::File& file, IoMethod method, std::optional<ChecksumSlot> checksums, BytesDone progress)
    : impl_(std::make_unique<Impl>(file)) {
  Impl& m = *impl_;
  m.path = file.path();
  m.method = method;
  m.checksums = checksums;
  m.progress = std::move(progress);
  if (method == IoMethod::raw) return;
  m.channel = std::make_unique<hdf5::Channel>(m.file);
  m.h5 = hdf5::open_file(*m.channel, true, Errc::hdf5);
}

PieceWriter::PieceWriter(PieceWriter&&) noexcept = default;
PieceWriter& PieceWriter::operator=(PieceWriter&&) noexcept = default;
PieceWriter::~PieceWriter() {
  if (!impl_) return;
  // An abandoned writer (its save failed): close HDF5 objects before the channel they use.
  impl_->sets.clear();
  impl_->h5 = Hid();
}

void PieceWriter::Impl::flush_hashes() {
  if (hashes.empty()) return;
  const Where w{path, "", "write the checksums"};
  const auto n = static_cast<std::int64_t>(hashes.size());
  const std::int64_t first = checksums->first_checksum + hashes_written;
  if (method == IoMethod::raw) {
    file.pwrite_all(hashes.data(), hashes.size() * sizeof(std::uint64_t),
                    checksums->table_address + static_cast<std::uint64_t>(first) * sizeof(std::uint64_t));
  } else {
    const std::int64_t total = hdf5::shape_of(dataset(checksums_set, w), w, Errc::hdf5).at(0);
    require(first + n <= total, Errc::internal, "checksums past the end of the table");
    hdf5::write_box(dataset(checksums_set, w), DType::u64, std::vector<std::int64_t>{total}, {{first, first + n}, {0, 1}},
                    hashes.data(), w);
  }
  hashes_written += n;
  hashes.clear();
}

void PieceWriter::write(const Dataset& d, const Box& box, TensorView src) {
  Impl& m = *impl_;
  check_box(d, box, src.dtype(), src.bytes(), m.path);
  if (box.empty()) return;
  const std::int64_t es = element_bytes(d.dtype), row_bytes = box.cols.size() * es;
  require(m.method == IoMethod::hyperslab || !d.regions.empty(), Errc::invalid_argument, "key ", d.key,
          ": the direct path needs a dataset whose raw data it can address");
  const Where w{m.path, d.key, "write a piece"};
  const auto* bytes = static_cast<const std::byte*>(static_cast<const void*>(src.data()));
  const std::int64_t step = batch_rows(row_bytes);
  for (std::int64_t r0 = box.rows.begin; r0 < box.rows.end; r0 += step) {
    const Box batch{{r0, std::min(r0 + step, box.rows.end)}, box.cols};
    const std::byte* p = bytes + (r0 - box.rows.begin) * row_bytes;
    // Each row's checksum is taken just before its bytes go out, while they are in cache.
    if (m.checksums)
      for (std::int64_t r = 0; r < batch.rows.size(); ++r) {
        m.hashes.push_back(row_hash(p + r * row_bytes, static_cast<std::size_t>(row_bytes)));
        if (m.hashes.size() == Impl::hash_batch) m.flush_hashes();
      }
    if (m.method == IoMethod::raw)
      transfer(m.file.path(), d.regions, es, batch, p, row_bytes,
               [&](const std::byte* q, std::size_t run, std::size_t rows, std::uint64_t at, std::int64_t file_stride) {
                 if (static_cast<std::int64_t>(run) == file_stride && file_stride == row_bytes)
                   return m.file.pwrite_all(q, run * rows, at);
                 for (std::size_t r = 0; r < rows; ++r)
                   m.file.pwrite_all(q + r * row_bytes, run, at + r * static_cast<std::uint64_t>(file_stride));
               });
    else
      hdf5::write_box(m.dataset(d.key, w), d.dtype, d.shape, batch, p, w);
    if (m.progress) m.progress(batch.rows.size() * row_bytes);
  }
}

void PieceWriter::write(const Dataset& d, std::span<const std::int64_t> offset,
                        std::span<const std::int64_t> count, TensorView src) {
  write(d, box_of(d, offset, count), src);
}

void PieceWriter::finish() {
  Impl& m = *impl_;
  m.flush_hashes();
  if (m.method == IoMethod::hyperslab) {
    for (auto& [key, set] : m.sets) set.close({m.path, key, "write a piece"});
    m.sets.clear();
    hdf5::close_written(m.h5, *m.channel, "write pieces");
  }
  m.file.sync();
}

void mark_complete(io::File& f, std::span<const Range> data) {
  const Where w{f.path(), "", "mark the checkpoint complete"};
  hdf5::Channel channel(f);
  {
    Hid file = hdf5::open_file(channel, true, Errc::hdf5);
    Hid meta = owned(H5Gopen2(file.get(), meta_group, H5P_DEFAULT), H5Gclose, w);
    hdf5::write_attr(meta.get(), "complete", std::int64_t{1}, w);
    meta.close(w);
    hdf5::close_written(file, channel, "mark the checkpoint complete");
  }
  write_seal(f, data);
  f.sync();
}

namespace {

// Checks parameter records against the datasets they name: every block a dataset of the block's
// shape, no dataset named twice, one dtype per parameter. `find(key)` gives a dataset (or throws);
// `bad(record, why)` throws for a contradiction.
template <class Find, class Bad>
void check_records(const std::vector<ParamRecord>& records, Find&& find, Bad&& bad) {
  std::set<std::string> covered;
  for (const ParamRecord& r : records) {
    std::optional<DType> dtype;
    for (const Section& b : r.blocks) {
      const std::string key = block_key(r.key, b.name);
      if (!covered.insert(key).second) bad(r, cat("names dataset ", key, ", which another record names too"));
      const Dataset* d = nullptr;
      try {
        d = &find(key);
      } catch (const Error& e) {
        bad(r, cat("names dataset ", key, ": ", e.what()));
      }
      std::vector<std::int64_t> want{b.rows};
      want.insert(want.end(), r.trailing.begin(), r.trailing.end());
      if (d->shape != want)
        bad(r, cat("says block ", key, " has shape ", dims_text(want), " but the dataset has ", dims_text(d->shape)));
      if (dtype && *dtype != d->dtype) bad(r, "has blocks of different dtypes");
      dtype = d->dtype;
    }
  }
}

}  // namespace

// ---- the reader ---------------------------------------------------------------------------------------

namespace {

// Whether every element of a dataset has stored bytes: a contiguous dataset its whole storage, a
// chunked one every chunk of its grid (HDF5 reads a missing chunk, or unallocated contiguous
// storage, as the fill value without an error).
bool fully_stored(hid_t set, hid_t dcpl, const Where& w) {
  const Errc no = Errc::not_a_checkpoint;
  const std::vector<std::int64_t> shape = hdf5::shape_of(set, w, no);
  if (element_count(shape) == 0) return true;
  switch (H5Pget_layout(dcpl)) {
    case H5D_COMPACT:
      return true;
    case H5D_CONTIGUOUS: {
      Hid type = owned(H5Dget_type(set), H5Tclose, w, no);
      const auto want = static_cast<hsize_t>(element_count(shape)) * H5Tget_size(type.get());
      return H5Dget_storage_size(set) >= want;
    }
    case H5D_CHUNKED: {
      std::vector<hsize_t> chunk(shape.size());
      if (H5Pget_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()) != static_cast<int>(chunk.size())) break;
      std::int64_t want = 1;
      for (std::size_t d = 0; d < shape.size(); ++d) {
        if (chunk[d] == 0) return false;
        const auto c = static_cast<std::int64_t>(chunk[d]);
        want = checked_mul(want, (shape[d] + c - 1) / c, "chunks of a dataset", no);
      }
      hsize_t have = 0;
      Hid space = owned(H5Dget_space(set), H5Sclose, w, no);
      if (H5Dget_num_chunks(set, space.get(), &have) < 0) break;
      return static_cast<std::int64_t>(have) == want;
    }
    default:
      break;
  }
  H5Eclear2(H5E_DEFAULT);
  return false;
}

}  // namespace

struct CheckpointReader::Impl {
  // A file beside the checkpoint that holds a dataset's bytes (HDF5 external storage), opened by the
  // reader itself: HDF5 never opens it by name.
  struct External {
    io::File file;
    std::optional<io::BulkReader> bulk;
  };
  struct Entry {
    std::optional<Dataset> info;
    std::string skipped;                  // why it is not a tensor
    std::optional<std::string> external;  // the file beside the checkpoint that holds its bytes
    std::uint64_t external_offset = 0;
    std::optional<std::vector<RawRegion>> regions;
    std::optional<std::vector<Slab>> slabs;  // sorted by first row
    std::vector<std::int64_t> slab_reach;    // running maximum of the slabs' end rows
  };

  fs::path path;
  io::Directory dir;  // the checkpoint's directory, where external files are opened
  io::File file;
  // Bulk reads of `file` through the page cache, and (opened on first use, under the mutex) around it.
  std::optional<io::BulkReader> cached, uncached;
  std::unique_ptr<SealedMetadata> sealed;  // checks every read HDF5 makes (a current seal)
  std::unique_ptr<hdf5::Channel> channel;
  Hid h5;
  Hid checksums;  // the checksum table (version 2)
  int version = 0;
  bool checksummed = false;
  CheckpointContents contents;
  std::int64_t checksum_count = 0;
  std::optional<std::uint64_t> checksums_address;
  std::uint64_t file_size = 0;
  std::optional<std::uint64_t> seal;

  mutable std::mutex mutex;                         // guards everything below
  std::map<std::string, Entry, std::less<>> index;  // the datasets looked at so far
  std::map<std::string, External, std::less<>> externals;
  std::optional<std::vector<Dataset>> all;
  std::optional<std::vector<std::pair<std::string, std::string>>> skipped;
  std::optional<std::vector<ParamRecord>> checked_params;

  [[noreturn]] void refuse(std::string_view why) const {
    throw Error(Errc::not_a_checkpoint, cat(path.string(), " is not a shardckpt checkpoint: ", why));
  }
  void open(const fs::path& p);
  Hid group(hid_t parent, const char* name, std::string_view shown, const Where& w) const;
  Entry& entry(std::string_view key);
  void read_header(const std::string& name, Entry& e) const;
  const Dataset& info(std::string_view key);
  void read_storage(hid_t set, const std::string& name, Entry& e, const Where& w) const;
  External& external(const std::string& name);
  const std::vector<RawRegion>& regions_for(Entry& e);
  const std::vector<Slab>& slabs_for(Entry& e);
  void read_checksums(std::int64_t first, std::int64_t n, std::uint64_t* out) const;
  void raw_read(const Dataset& d, Entry& e, const Box& box, std::byte* mem, std::int64_t mem_row_elems,
                std::int64_t mem_col, const ReadOptions& options);
  void read_checked(const Dataset& d, Entry& e, const Slab& s, const Box& sub, const Box& box, std::byte* out,
                    const ReadOptions& options);
  void read_metadata();
  void read_checksum_table(hid_t meta, const Where& w);
};

// The group `name` of `parent`, reached through a hard link only (`shown` names it in messages).
Hid CheckpointReader::Impl::group(hid_t parent, const char* name, std::string_view shown, const Where& w) const {
  if (!hdf5::hard_link_exists(parent, name, w) || hdf5::object_type(parent, name, w) != H5O_TYPE_GROUP)
    refuse(cat("it has no ", shown, " group"));
  return owned(H5Gopen2(parent, name, H5P_DEFAULT), H5Gclose, w, Errc::not_a_checkpoint);
}

void CheckpointReader::Impl::read_metadata() {
  const Where w{path, "", "read the checkpoint metadata"};
  const Errc no = Errc::not_a_checkpoint;
  Hid meta = group(h5.get(), meta_group, "/_shardckpt", w);
  for (const char* name : {"format", "format_version", "kind", "params"})
    if (!hdf5::has_attr(meta.get(), name, w)) refuse(cat("/_shardckpt has no attribute ", name));
  if (hdf5::read_string(meta.get(), "format", w, no) != "shardckpt") refuse("/_shardckpt names another format");
  const std::int64_t v = hdf5::read_int(meta.get(), "format_version", w, no);
  if (v < 1 || v > format_version)
    refuse(cat("format version ", v, " is not one this library reads (1 to ", format_version, ")"));
  version = static_cast<int>(v);
  if (!hdf5::has_attr(meta.get(), "complete", w)) refuse("the save that wrote it did not finish");
  if (hdf5::read_int(meta.get(), "complete", w, no) != 1)
    refuse("attribute complete is not 1: the save that wrote it did not finish");
  const std::string kind = hdf5::read_string(meta.get(), "kind", w, no);
  if (kind != "global" && kind != "local") refuse(cat("attribute kind is '", kind, "', not global or local"));
  contents.kind = kind == "local" ? CheckpointKind::local : CheckpointKind::global;
  try {
    contents.params = params_from_json(hdf5::read_string(meta.get(), "params", w, no));
  } catch (const Error& e) {
    if (e.code() == no) throw;
    refuse(cat("attribute params does not hold valid parameter records: ", e.what()));
  } catch (const std::exception& e) {  // not JSON, or fields of the wrong type
    refuse(cat("attribute params does not hold valid parameter records: ", e.what()));
  }
  Hid common = group(meta.get(), "common", "/_shardckpt/common", w);
  hdf5::for_each_attr(common.get(), w, [&](const char* name) {
    contents.common.emplace(name, hdf5::read_value(common.get(), name, w, no));
  });
  contents.checksummed = false;
  if (version < 2) return;

  for (const char* name : {"checkpoint_id", "checksums"})
    if (!hdf5::has_attr(meta.get(), name, w)) refuse(cat("/_shardckpt has no attribute ", name));
  contents.id = hdf5::read_string(meta.get(), "checkpoint_id", w, no);
  if (contents.id.size() != 32 || contents.id.find_first_not_of("0123456789abcdef") != std::string::npos)
    refuse("attribute checkpoint_id is not 32 hex digits");
  const std::string scheme = hdf5::read_string(meta.get(), "checksums", w, no);
  if (scheme == no_checksums) return;
  if (scheme != checksum_scheme) refuse("attribute checksums names a checksum scheme this library does not know");
  checksummed = contents.checksummed = true;
  (void)group(meta.get(), "slabs", "/_shardckpt/slabs", w);
  read_checksum_table(meta.get(), w);
}

// The checksum table is read by address only: a table stored any other way (chunked, external,
// virtual) is refused rather than read through HDF5.
void CheckpointReader::Impl::read_checksum_table(hid_t meta, const Where& w) {
  const Errc no = Errc::not_a_checkpoint;
  if (!hdf5::hard_link_exists(meta, "checksums", w) || hdf5::object_type(meta, "checksums", w) != H5O_TYPE_DATASET)
    refuse("it has no /_shardckpt/checksums dataset");
  const Where cw{path, checksums_set, "read the checksum table"};
  checksums = owned(H5Dopen2(meta, "checksums", H5P_DEFAULT), H5Dclose, cw, no);
  Hid type = owned(H5Dget_type(checksums.get()), H5Tclose, cw, no);
  const std::vector<std::int64_t> shape = hdf5::shape_of(checksums.get(), cw, no);
  if (shape.size() != 1 || hdf5::dtype_of(type.get()) != DType::u64)
    refuse("/_shardckpt/checksums is not a 1-D table of u64");
  checksum_count = shape[0];
  if (checksum_count == 0) return;
  Hid dcpl = owned(H5Dget_create_plist(checksums.get()), H5Pclose, cw, no);
  const bool plain = H5Pget_external_count(dcpl.get()) == 0 && H5Pget_layout(dcpl.get()) == H5D_CONTIGUOUS;
  H5Eclear2(H5E_DEFAULT);
  const std::vector<RawRegion> table =
      plain ? raw_regions_of(checksums.get(), type.get(), shape, DType::u64, cw) : std::vector<RawRegion>{};
  if (table.size() != 1) refuse("its checksum table is not stored contiguously in the file");
  const std::uint64_t bytes = static_cast<std::uint64_t>(checksum_count) * sizeof(std::uint64_t);
  if (table[0].address > file_size || bytes > file_size - table[0].address)
    refuse("its checksum table ends past the end of the file (truncated)");
  checksums_address = table[0].address;
}

// Opens the file itself, in its directory, which stays open for the external files beside it.
void CheckpointReader::Impl::open(const fs::path& p) {
  path = p;
  const fs::path target = io::follow_links(p);
  const std::string name = target.filename().string();
  if (io::is_temporary_name(name))
    refuse("it is the temporary file of a save that did not finish, or is still running (docs/cluster.md: "
           "remove it once no save runs)");
  std::error_code ec;
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  if (!fs::is_directory(parent, ec)) refuse("no such file");
  dir = io::Directory::open(parent);
  if (!dir.status(name)) refuse("no such file");
  try {
    file = dir.open_regular(name, Errc::not_a_checkpoint);
  } catch (const Error& e) {
    if (e.code() == Errc::not_a_checkpoint) refuse(e.what());
    throw;
  }
  file_size = file.size();
}

CheckpointReader::CheckpointReader(const fs::path& path, OpenOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.open(path);
  // Before HDF5 reads a byte: damaged metadata of a sealed file never reaches HDF5's parser, and
  // with a current seal every later read is checked again (a file changed in place is an error).
  std::optional<Seal> seal = check_seal(m.file, options.trusted_seal);
  if (options.require_seal && !seal)
    m.refuse("it has no seal, so its metadata cannot be checked before HDF5 reads it");
  if (seal) {
    m.seal = seal->digest;
    m.sealed = std::move(seal->pages);
  }
  m.cached.emplace(m.file, io::PageCache::use);
  m.channel = m.sealed ? std::make_unique<hdf5::Channel>(m.file, *m.sealed) : std::make_unique<hdf5::Channel>(m.file);
  try {
    m.h5 = hdf5::open_file(*m.channel, false, Errc::not_a_checkpoint);
  } catch (const Error& e) {
    if (e.code() == Errc::io || e.code() == Errc::corrupt) throw;
    m.refuse(cat("not an HDF5 file HDF5 can open (", e.what(), ")"));
  }
  m.read_metadata();
}

CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

// The entry of a dataset, its header read on first use (only the datasets a rank looks at).
CheckpointReader::Impl::Entry& CheckpointReader::Impl::entry(std::string_view key) {
  const auto it = index.find(key);
  if (it != index.end()) return it->second;
  const std::string name(key);
  const Where w{path, name, "find the dataset"};
  require(name != meta_group && io::plain_name(name) && hdf5::link_exists(h5.get(), name.c_str(), w),
          Errc::missing_key, "key ", key, " is not in ", path.string());
  Entry e;
  read_header(name, e);
  return index.emplace(name, std::move(e)).first->second;
}

void CheckpointReader::Impl::read_header(const std::string& name, Entry& e) const {
  const Where dw{path, name, "read the dataset header"};
  const Errc no = Errc::not_a_checkpoint;
  if (!hdf5::hard_link_exists(h5.get(), name.c_str(), dw)) {
    e.skipped = "a soft or external link (not followed)";
    return;
  }
  if (hdf5::object_type(h5.get(), name.c_str(), dw) != H5O_TYPE_DATASET) {
    e.skipped = "not a dataset";
    return;
  }
  Hid set = owned(H5Dopen2(h5.get(), name.c_str(), H5P_DEFAULT), H5Dclose, dw, no);
  Hid type = owned(H5Dget_type(set.get()), H5Tclose, dw, no);
  const std::optional<DType> dtype = hdf5::dtype_of(type.get());
  if (!dtype) {
    e.skipped = "an element type shardckpt does not store";
    return;
  }
  std::vector<std::int64_t> shape = hdf5::shape_of(set.get(), dw, no);
  if (shape.empty()) {
    e.skipped = "a scalar dataset (tensors have at least one dimension)";
    return;
  }
  Dataset info{name, *dtype, std::move(shape)};
  read_storage(set.get(), name, e, dw);
  if (hdf5::has_attr(set.get(), "global_shape", dw)) {
    // A local file's piece: its box in the global dataset (earlier files kept an N-D offset instead).
    PiecePlacement p{name, hdf5::read_ints(set.get(), "global_shape", 0, 32, dw, no), {}};
    try {
      if (hdf5::has_attr(set.get(), "global_key", dw)) p.key = hdf5::read_string(set.get(), "global_key", dw, no);
      if (hdf5::has_attr(set.get(), "global_box", dw)) {
        const std::vector<std::int64_t> b = hdf5::read_ints(set.get(), "global_box", 0, 4, dw, no);
        require(b.size() == 4, Errc::not_a_checkpoint, "global_box is not 4 values");
        p.box = {{b[0], b[1]}, {b[2], b[3]}};
      } else {
        p.box = footprint(name, p.global_shape, hdf5::read_ints(set.get(), "global_offset", 0, 32, dw, no), info.shape);
      }
      const Box whole = whole_box(p.global_shape);
      require(p.box.rows.begin >= 0 && p.box.rows.begin <= p.box.rows.end && p.box.rows.end <= whole.rows.end &&
                  p.box.cols.begin >= 0 && p.box.cols.begin <= p.box.cols.end && p.box.cols.end <= whole.cols.end &&
                  box_elements(p.box) == element_count(info.shape),
              Errc::not_a_checkpoint, "its box does not fit the global shape or the dataset");
    } catch (const Error& e) {
      refuse(cat("dataset ", name, ": its placement (global_shape, global_box) is not valid: ", e.what()));
    }
    info.placement = std::move(p);
  }
  e.info = std::move(info);
}

// How the dataset's bytes are stored, refusing what the reader cannot read as the file means it.
// Virtual datasets (bytes in other files, and fill values where those are missing) are refused;
// bytes in another file (external storage) must sit in one plain file of the checkpoint's own
// directory, which the reader opens itself (a file could otherwise make a load read any file its
// user can, /etc/shadow, say); data that was never stored (HDF5 would read its fill value) is
// refused.
void CheckpointReader::Impl::read_storage(hid_t set, const std::string& name, Entry& e, const Where& w) const {
  Hid dcpl = owned(H5Dget_create_plist(set), H5Pclose, w, Errc::not_a_checkpoint);
  if (H5Pget_layout(dcpl.get()) == H5D_VIRTUAL)
    refuse(cat("dataset ", name, " is an HDF5 virtual dataset (its bytes live in other files, and read as fill ",
               "values where those are missing): shardckpt does not read virtual datasets"));
  const int n = H5Pget_external_count(dcpl.get());
  if (n < 0) refuse(cat("dataset ", name, ": its external storage cannot be read"));
  if (n > 0) {
    char file[256] = {};
    off_t offset = 0;
    hsize_t size = 0;
    if (n != 1 || H5Pget_external(dcpl.get(), 0, sizeof file, file, &offset, &size) < 0 ||
        std::strlen(file) >= sizeof file - 1 || !io::plain_name(file) || offset < 0)
      refuse(cat("dataset ", name, " keeps its bytes in '", std::string_view(file, strnlen(file, sizeof file)), "'",
                 n > 1 ? " and other files" : "", ", not a plain file beside the checkpoint"));
    e.external = file;
    e.external_offset = static_cast<std::uint64_t>(offset);
    return;
  }
  if (!fully_stored(set, dcpl.get(), w))
    refuse(cat("dataset ", name, " has elements that were never stored (HDF5 would read them as its fill value)"));
}

CheckpointReader::Impl::External& CheckpointReader::Impl::external(const std::string& name) {
  const auto it = externals.find(name);
  if (it != externals.end()) return it->second;
  io::File f = dir.open_regular(name, Errc::not_a_checkpoint);
  External& out = externals.try_emplace(name).first->second;
  out.file = std::move(f);
  out.bulk.emplace(out.file, io::PageCache::use);
  return out;
}

const Dataset& CheckpointReader::Impl::info(std::string_view key) {
  Entry& e = entry(key);
  if (!e.info) refuse(cat("the object ", key, " is ", e.skipped, ", not a tensor"));
  return *e.info;
}

const std::vector<RawRegion>& CheckpointReader::Impl::regions_for(Entry& e) {
  if (e.regions) return *e.regions;
  const Dataset& d = *e.info;
  std::vector<RawRegion> extents;
  std::uint64_t size = file_size;
  std::string_view where = "the file";
  if (e.external) {
    size = external(*e.external).file.size();
    where = *e.external;
    if (!whole_box(d.shape).empty()) extents.push_back({whole_box(d.shape), e.external_offset});
  } else {
    const Where dw{path, d.key, "locate the dataset's data"};
    Hid set = owned(H5Dopen2(h5.get(), d.key.c_str(), H5P_DEFAULT), H5Dclose, dw, Errc::not_a_checkpoint);
    Hid type = owned(H5Dget_type(set.get()), H5Tclose, dw, Errc::not_a_checkpoint);
    extents = raw_regions_of(set.get(), type.get(), d.shape, d.dtype, dw);
  }
  for (const RawRegion& x : extents) {
    const auto bytes = static_cast<std::uint64_t>(box_elements(x.box)) * dtype_size(d.dtype);
    if (x.address > size || bytes > size - x.address)
      refuse(cat("dataset ", d.key, " ends at byte ", x.address + bytes, " but ", where, " has ", size,
                 " (truncated)"));
  }
  return *(e.regions = std::move(extents));
}

const std::vector<Slab>& CheckpointReader::Impl::slabs_for(Entry& e) {
  if (e.slabs) return *e.slabs;
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
  std::int64_t reach = 0;
  e.slab_reach.reserve(slabs.size());
  for (const Slab& s : slabs) e.slab_reach.push_back(reach = std::max(reach, s.box.rows.end));
  return *(e.slabs = std::move(slabs));
}

void CheckpointReader::Impl::read_checksums(std::int64_t first, std::int64_t n, std::uint64_t* out) const {
  if (n == 0) return;
  if (checksums_address) {
    file.pread_all(out, static_cast<std::size_t>(n) * sizeof(std::uint64_t),
                   *checksums_address + static_cast<std::uint64_t>(first) * sizeof(std::uint64_t));
    return;
  }
  hdf5::read_box(checksums.get(), DType::u64, std::vector<std::int64_t>{checksum_count}, {{first, first + n}, {0, 1}}, out,
                 1, 0, {path, checksums_set, "read checksums"});
}

void CheckpointReader::Impl::raw_read(const Dataset& d, Entry& e, const Box& box, std::byte* mem,
                                      std::int64_t mem_row_elems, std::int64_t mem_col, const ReadOptions& options) {
  const std::int64_t es = element_bytes(d.dtype);
  // Bytes in an external file are always read here: HDF5 would open the file by name.
  if (options.method == IoMethod::raw || e.external) {
    const io::File* from = &file;
    const io::BulkReader* bulk = &*cached;
    const std::vector<RawRegion>* extents = nullptr;
    {
      const std::lock_guard lock(mutex);
      extents = &regions_for(e);
      if (e.external) {
        External& x = external(*e.external);
        from = &x.file;
        bulk = &*x.bulk;
      } else if (options.bypass_page_cache) {
        if (!uncached) uncached.emplace(file, io::PageCache::bypass);
        bulk = &*uncached;
      }
    }
    if (!extents->empty() || e.external) {
      const std::int64_t stride = mem_row_elems * es;
      transfer(path, *extents, es, box, mem + mem_col * es, stride,
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
      return;
    }
  }
  // Datasets the direct path cannot address (filtered, small chunks, another byte order) go through HDF5.
  const Where w{path, d.key, "read a piece"};
  Hid set = owned(H5Dopen2(h5.get(), d.key.c_str(), H5P_DEFAULT), H5Dclose, w, Errc::not_a_checkpoint);
  hdf5::read_box(set.get(), d.dtype, d.shape, box, mem, mem_row_elems, mem_col, w);
}

const fs::path& CheckpointReader::path() const noexcept { return impl_->path; }
int CheckpointReader::version() const noexcept { return impl_->version; }
bool CheckpointReader::checksummed() const noexcept { return impl_->checksummed; }
io::FileIdentity CheckpointReader::identity() const { return impl_->file.identity(); }
std::optional<std::uint64_t> CheckpointReader::seal() const noexcept { return impl_->seal; }
const CheckpointContents& CheckpointReader::contents() const noexcept { return impl_->contents; }

std::uint64_t CheckpointReader::fingerprint() const {
  const Impl& m = *impl_;
  std::string text = cat(m.contents.id, "\n", m.seal.value_or(0), "\n", m.file_size, "\n", m.version, "\n",
                         static_cast<int>(m.contents.kind), "\n", params_json(m.contents.params).dump(), "\n");
  for (const auto& [key, value] : m.contents.common)
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double>)
            text += cat(key.size(), ":", key, "=f", std::bit_cast<std::uint64_t>(v), ";");
          else if constexpr (std::is_same_v<T, std::string>)
            text += cat(key.size(), ":", key, "=s", v.size(), ":", v, ";");
          else
            text += cat(key.size(), ":", key, "=i", v, ";");
        },
        value);
  return row_hash(text.data(), text.size());
}

const std::vector<ParamRecord>& CheckpointReader::params() const {
  Impl& m = *impl_;
  {
    const std::lock_guard lock(m.mutex);
    if (m.checked_params) return *m.checked_params;
  }
  check_records(
      m.contents.params,
      [&](const std::string& key) -> const Dataset& {
        const std::lock_guard lock(m.mutex);
        return m.info(key);
      },
      [&](const ParamRecord& r, std::string_view why) {
        m.refuse(cat("attribute params: the record of ", r.key, " ", why));
      });
  const std::lock_guard lock(m.mutex);
  if (!m.checked_params) m.checked_params = m.contents.params;
  return *m.checked_params;
}

const std::vector<Dataset>& CheckpointReader::datasets() const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  if (!m.all) {
    std::vector<Dataset> all;
    std::vector<std::pair<std::string, std::string>> skipped;
    for (const std::string& name : hdf5::link_names(m.h5.get(), {m.path, "", "list the datasets"})) {
      if (name == meta_group) continue;
      const Impl::Entry& e = m.entry(name);
      if (e.info)
        all.push_back(*e.info);
      else
        skipped.emplace_back(name, e.skipped);
    }
    m.all = std::move(all);
    m.skipped = std::move(skipped);
  }
  return *m.all;
}

const std::vector<std::pair<std::string, std::string>>& CheckpointReader::skipped() const {
  (void)datasets();
  return *impl_->skipped;
}

const Dataset& CheckpointReader::dataset(std::string_view key) const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  return m.info(key);
}

std::vector<Slab> CheckpointReader::slabs(const Dataset& d) const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  Impl::Entry& e = m.entry(d.key);
  (void)m.info(d.key);
  return m.slabs_for(e);
}

// Reads `sub` (the part of `box` that slab `s` holds) into `out` (the rows of `box`), checking
// every row read against its checksum in batches. Whole rows (the slab's rows lie inside the box's
// columns) are read in place; rows that reach past the box are read whole into scratch memory,
// checked, and the asked-for part copied.
void CheckpointReader::Impl::read_checked(const Dataset& d, Entry& e, const Slab& s, const Box& sub,
                                          const Box& box, std::byte* out, const ReadOptions& options) {
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
      raw_read(d, e, {{r0, r1}, s.box.cols}, rows, width, s.box.cols.begin - box.cols.begin, options);
      for (std::int64_t r = 0; r < n; ++r)
        if (row_hash(rows + (r * width + s.box.cols.begin - box.cols.begin) * es,
                     static_cast<std::size_t>(unit_bytes)) != want[static_cast<std::size_t>(r)])
          mismatch(r0 + r);
    } else {
      scratch.resize(static_cast<std::size_t>(n * unit_bytes));
      raw_read(d, e, {{r0, r1}, s.box.cols}, scratch.data(), s.box.cols.size(), 0, options);
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
  Impl& m = *impl_;
  check_box(d, box, dst.dtype(), dst.bytes(), m.path);
  if (box.empty()) return;
  auto* out = static_cast<std::byte*>(static_cast<void*>(dst.data()));
  const std::int64_t es = element_bytes(d.dtype), width = box.cols.size();
  Impl::Entry* e = nullptr;
  const std::vector<Slab>* slabs = nullptr;
  {
    const std::lock_guard lock(m.mutex);
    e = &m.entry(d.key);
    (void)m.info(d.key);
    if (options.verify && m.checksummed) slabs = &m.slabs_for(*e);
  }
  if (!slabs) {
    m.raw_read(d, *e, box, out, width, 0, options);
    if (options.progress) options.progress(box_elements(box) * es);
    return;
  }
  std::int64_t covered = 0;
  // The slabs that can meet the box: those starting before its end whose reach passes its start.
  const auto first = std::upper_bound(e->slab_reach.begin(), e->slab_reach.end(), box.rows.begin) - e->slab_reach.begin();
  for (auto i = static_cast<std::size_t>(first); i < slabs->size() && (*slabs)[i].box.rows.begin < box.rows.end; ++i) {
    const Slab& s = (*slabs)[i];
    const Box sub = s.box.intersect(box);
    if (sub.empty()) continue;
    covered += box_elements(sub);
    m.read_checked(d, *e, s, sub, box, out, options);
  }
  require(covered == box_elements(box), Errc::not_a_checkpoint, m.path.string(), ": the slab table of ", d.key,
          " does not cover ", rows_text(box, whole_box(d.shape)));
}

void CheckpointReader::read(const Dataset& d, std::span<const std::int64_t> offset,
                            std::span<const std::int64_t> count, MutTensorView dst, ReadOptions options) const {
  read(d, box_of(d, offset, count), dst, options);
}

std::string records_json(const std::vector<ParamRecord>& records) { return params_json(records).dump(); }

std::vector<ParamRecord> parse_records(std::string_view json_text) {
  try {
    return params_from_json(json_text);
  } catch (const Error& e) {
    throw Error(Errc::invalid_argument, cat("not valid parameter records: ", e.what()));
  } catch (const std::exception& e) {
    throw Error(Errc::invalid_argument, cat("not valid parameter records: ", e.what()));
  }
}

namespace {

// A dataset of a plain file, and where its row-major bytes are.
struct PlainDataset {
  std::string key;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t address;
};

// The tensors at the root of a plain HDF5 file; anything adopt cannot point at is an error.
std::vector<PlainDataset> plain_datasets(io::File& f) {
  const fs::path& plain = f.path();
  const std::uint64_t size = f.size();
  hdf5::Channel channel(f);
  Hid h5 = hdf5::open_file(channel, false, Errc::not_a_checkpoint);
  std::vector<PlainDataset> out;
  for (const std::string& name : hdf5::link_names(h5.get(), {plain, "", "list the datasets"})) {
    const Where w{plain, name, "adopt the dataset"};
    const auto cannot = [&](std::string_view why) {
      throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": ", name, " ", why));
    };
    if (name == meta_group) cannot("exists: the file is a shardckpt checkpoint already");
    if (!hdf5::hard_link_exists(h5.get(), name.c_str(), w) || hdf5::object_type(h5.get(), name.c_str(), w) != H5O_TYPE_DATASET)
      cannot("is not a dataset");
    Hid set = owned(H5Dopen2(h5.get(), name.c_str(), H5P_DEFAULT), H5Dclose, w, Errc::not_a_checkpoint);
    Hid type = owned(H5Dget_type(set.get()), H5Tclose, w, Errc::not_a_checkpoint);
    const std::optional<DType> dtype = hdf5::dtype_of(type.get());
    std::vector<std::int64_t> shape = hdf5::shape_of(set.get(), w, Errc::not_a_checkpoint);
    if (!dtype || !hdf5::stored_exactly(type.get(), *dtype) || shape.empty())
      cannot("is not a tensor of a type shardckpt stores as it is (a little-endian number, at least one dimension)");
    Hid dcpl = owned(H5Dget_create_plist(set.get()), H5Pclose, w, Errc::not_a_checkpoint);
    const haddr_t address = H5Dget_offset(set.get());
    H5Eclear2(H5E_DEFAULT);
    const auto bytes = static_cast<std::uint64_t>(element_count(shape)) * dtype_size(*dtype);
    if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS || H5Pget_external_count(dcpl.get()) != 0 ||
        address == HADDR_UNDEF || address > size || bytes > size - address)
      cannot("is not stored contiguously in the file (rewrite it with h5repack -l CONTI)");
    out.push_back({name, *dtype, std::move(shape), address});
  }
  if (out.empty()) throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": it holds no dataset"));
  return out;
}

// The XXH3-64 of every row of every dataset, read from the plain file once, in dataset order.
std::vector<std::uint64_t> row_hashes(const io::File& f, const std::vector<PlainDataset>& sets) {
  std::vector<std::uint64_t> out;
  std::vector<std::byte> batch;
  for (const PlainDataset& d : sets) {
    const std::int64_t row = element_count(std::span(d.shape).subspan(1)) * element_bytes(d.dtype);
    const std::int64_t step = batch_rows(row);
    for (std::int64_t r0 = 0; r0 < d.shape[0]; r0 += step) {
      const std::int64_t n = std::min(step, d.shape[0] - r0);
      batch.resize(static_cast<std::size_t>(n * row));
      f.pread_all(batch.data(), batch.size(), d.address + static_cast<std::uint64_t>(r0 * row));
      for (std::int64_t r = 0; r < n; ++r) out.push_back(row_hash(batch.data() + r * row, static_cast<std::size_t>(row)));
    }
  }
  return out;
}

// The records must describe the plain file's datasets (keys, shapes, one dtype per parameter).
void check_adopted_records(const std::vector<ParamRecord>& records, const std::vector<PlainDataset>& sets) {
  std::map<std::string, Dataset, std::less<>> by_key;
  for (const PlainDataset& d : sets) by_key.emplace(d.key, Dataset{d.key, d.dtype, d.shape});
  check_records(
      records,
      [&](const std::string& key) -> const Dataset& {
        const auto it = by_key.find(key);
        require(it != by_key.end(), Errc::missing_key, "the file has no dataset ", key);
        return it->second;
      },
      [](const ParamRecord& r, std::string_view why) {
        throw Error(Errc::invalid_argument,
                    cat("the parameter records do not describe its datasets: the record of ", r.key, " ", why));
      });
}

}  // namespace

AdoptReport adopt(const fs::path& plain, const fs::path& out, const std::vector<ParamRecord>& records,
                  const Values& common) {
  try {
    io::Destination dest = io::Destination::of(out);
    const fs::path source = io::follow_links(plain);
    const io::Directory dir = io::Directory::open(source.parent_path());
    io::File f = dir.open_regular(source.filename().string(), Errc::not_a_checkpoint);
    const io::FileStatus here = dir.status(), there = dest.dir.status();
    require(here.identity == there.identity, Errc::invalid_argument, out.string(),
            " must be in the same directory as ", plain.string(), " (the checkpoint finds the bytes beside it)");
    const std::optional<io::FileStatus> replaced = dest.dir.status(dest.name);
    require(!replaced || replaced->identity != f.identity(), Errc::invalid_argument, out.string(), " is ",
            plain.string(), " itself: the checkpoint would replace the file whose bytes it points at");
    const std::vector<PlainDataset> sets = plain_datasets(f);
    check_adopted_records(records, sets);
    std::vector<Dataset> specs;
    AdoptReport report;
    std::int64_t checksum_rows = 0;
    for (const PlainDataset& d : sets) {
      const Box whole = whole_box(d.shape);
      specs.push_back({d.key, d.dtype, d.shape, std::nullopt, {}, {}, ExternalData{source.filename().string(), d.address}});
      if (!whole.empty()) specs.back().slabs.push_back({whole, checksum_rows});
      checksum_rows += checksum_rows_of(whole);
      report.bytes += element_count(d.shape) * element_bytes(d.dtype);
    }
    const std::vector<std::uint64_t> hashes = row_hashes(f, sets);
    io::TemporaryFile temp = io::TemporaryFile::create(std::move(dest));
    const Skeleton skeleton =
        create_skeleton(temp.file(), specs, {CheckpointKind::global, records, common, io::random_id()}, checksum_rows);
    if (!hashes.empty())
      temp.file().pwrite_all(hashes.data(), hashes.size() * sizeof(std::uint64_t), skeleton.checksums_address);
    mark_complete(temp.file(), skeleton.data);
    temp.commit();
    report.tensors = static_cast<std::int64_t>(sets.size());
    report.params = static_cast<std::int64_t>(records.size());
    return report;
  } catch (Error& e) {
    throw std::move(e.add_context(cat("adopting ", plain.string())));
  }
}

VerifyReport verify_checkpoint(const CheckpointReader& reader,
                               const std::function<void(std::int64_t, std::int64_t)>& progress) {
  VerifyReport report;
  report.checksummed = reader.checksummed();
  (void)reader.params();
  std::int64_t total = 0, done = 0;
  for (const Dataset& d : reader.datasets())
    total = checked_add(total, checked_mul(element_count(d.shape), element_bytes(d.dtype), "dataset bytes"),
                        "checkpoint bytes");
  report.datasets = static_cast<std::int64_t>(reader.datasets().size());
  report.bytes = total;
  if (!report.checksummed) return report;
  std::vector<std::byte> buffer;
  for (const Dataset& d : reader.datasets()) {
    const std::int64_t es = element_bytes(d.dtype);
    for (const Slab& s : reader.slabs(d)) {
      const std::int64_t row_bytes = s.box.cols.size() * es, step = batch_rows(row_bytes);
      for (std::int64_t r0 = s.box.rows.begin; r0 < s.box.rows.end; r0 += step) {
        const Box batch{{r0, std::min(r0 + step, s.box.rows.end)}, s.box.cols};
        buffer.resize(static_cast<std::size_t>(box_elements(batch) * es));
        const MutTensorView view = MutTensorView::borrow(buffer.data(), d.dtype, {batch.rows.size(), batch.cols.size()});
        try {
          reader.read(d, batch, view);
          report.checksum_rows += batch.rows.size();
        } catch (const Error& e) {
          if (e.code() != Errc::corrupt) throw;
          // Find every bad row of the batch, not only the first.
          for (std::int64_t r = batch.rows.begin; r < batch.rows.end; ++r) {
            const Box row{{r, r + 1}, s.box.cols};
            try {
              reader.read(d, row, view.slice_rows(0, 1));
            } catch (const Error& bad) {
              if (bad.code() != Errc::corrupt) throw;
              if (report.mismatches++ < 16) report.problems.emplace_back(bad.what());
            }
            ++report.checksum_rows;
          }
        }
        done += box_elements(batch) * es;
        if (progress) progress(done, total);
      }
    }
  }
  return report;
}

}  // namespace shardckpt
