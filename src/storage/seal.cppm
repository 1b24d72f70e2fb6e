// shardckpt.storage:seal (implementation partition): the seal of a checkpoint's HDF5 metadata
// (docs/format.md, "The seal"). Rank 0 writes it when it marks a save complete; a reader checks it
// before HDF5 parses a byte, and every later read HDF5 makes through the reader's channel again
// (SealedMetadata), so that no byte HDF5 parses was changed after the seal was checked. It never
// lets HDF5 see a metadata byte it has not checked.
module;
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <vector>
module shardckpt.storage:seal;
import shardckpt.core;
import shardckpt.layout;
import :file;
import :hdf5;

namespace shardckpt {

// A range of bytes as the trailer stores it, and the hash of one 4 KiB page's metadata bytes.
struct DiskRange {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};
struct PageHash {
  std::uint64_t page = 0;
  std::uint64_t hash = 0;
};
inline constexpr std::uint64_t seal_page = 4096;


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

// What check_seal found: the digest ranks agree on, and (a current seal) the metadata every later
// HDF5 read is checked against.
struct Seal {
  std::uint64_t digest = 0;
  std::unique_ptr<SealedMetadata> pages;
};

// Seals a fully written file: `data` are the byte ranges of raw data, which the seal leaves out.
void write_seal(io::File& file, std::span<const Range> data);
// The file's seal, checked, or nothing for an unsealed file. With `trusted` (the digest another rank
// checked the whole seal of), only that this file's page table is the one with that digest.
std::optional<Seal> check_seal(const io::File& file, std::optional<std::uint64_t> trusted);

}  // namespace shardckpt
