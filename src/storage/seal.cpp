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
#include <string_view>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :raw;
import :seal;

namespace shardckpt {
namespace {

// The trailer past HDF5's end of the file: the metadata ranges, the page table (for every 4 KiB page
// of the file that holds metadata, the XXH3-64 of its metadata bytes in file order), then the tail,
// last. The seal's digest is the XXH3-64 of the ranges and the page table: what ranks agree on. A
// reader that trusts nothing checks every page once when it opens the file; afterwards every read
// HDF5 makes is checked again against the page table before HDF5 sees its bytes, so that a file
// changed in place under a reader is an error, never bytes HDF5 parses unchecked. Files sealed by
// shardckpt 0.2 (one hash over all metadata, magic "SHCKSEAL") are checked once, at open.

struct SealTail {  // "SHCKSEL2"
  std::uint64_t regions = 0;      // ranges after the sealed bytes
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
constexpr std::uint64_t seal_magic = 0x324c45534b434853;      // "SHCKSEL2"
constexpr std::uint64_t old_seal_magic = 0x4c4145534b434853;  // "SHCKSEAL"
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

}  // namespace

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

namespace {

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

}  // namespace

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

}  // namespace shardckpt
