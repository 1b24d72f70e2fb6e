// shardckpt.storage:reader: an open checkpoint, read as hostile input. The seal is checked before
// HDF5 parses a byte and again on every read HDF5 makes; every attribute, shape, address and table
// is checked before it is used; every byte read is checked against its row's checksum; every file
// is opened by the reader itself. Reads land straight in the caller's rows. Knows nothing of ranks.
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
export module shardckpt.storage:reader;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :file;
import :format;

namespace shardckpt {
// What an open CheckpointReader holds (the :reader_state partition): no consumer sees inside it.
struct ReaderState;
}  // namespace shardckpt

export namespace shardckpt {

struct ReadOptions {
  IoMethod method = IoMethod::raw;
  // Check every byte read against its checksum (Errc::corrupt on a mismatch).
  bool verify = true;
  BytesDone progress = {};
  // Read tensor data around the page cache (O_DIRECT) where the file system allows it; see
  // io::BulkReader. Metadata and checksums always go through the page cache.
  bool bypass_page_cache = false;
};

struct OpenOptions {
  // The seal another rank already checked for this file: only compare the file's to it (0: the
  // file must be unsealed). Unset: check the whole seal here.
  std::optional<std::uint64_t> trusted_seal = {};
  // Refuse (Errc::not_a_checkpoint) a file without a seal: one whose metadata HDF5 would parse
  // unchecked (written by another tool, changed by one after the save, or written before seals).
  bool require_seal = false;
};

// A part of a tensor mapped from the file (CheckpointReader::map): whole rows `box` of `dataset`.
struct MapPart {
  const Dataset* dataset = nullptr;
  Box box;
};

// A tensor to map (CheckpointReader::map_all): its parts in order, its dtype and its shape.
struct MapRequest {
  std::span<const MapPart> parts;
  DType dtype = DType::u8;
  Extents shape;
};

// An open, complete checkpoint. Metadata and data come from one open file: a path replaced while
// the reader is open does not change what it reads. Reads from many threads run in parallel on
// the raw path (IoMethod::raw).
class CheckpointReader {
 public:
  // Throws Errc::corrupt when the file's seal shows its metadata was damaged, Errc::replaced when
  // it does not match options.trusted_seal, and Errc::not_a_checkpoint for a file that is not a
  // complete shardckpt checkpoint (missing, foreign, unfinished, truncated, or with metadata that
  // contradicts itself), naming the attribute.
  explicit CheckpointReader(const std::filesystem::path& path, OpenOptions options = {});
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;
  ~CheckpointReader();

  const std::filesystem::path& path() const noexcept;
  int version() const noexcept;
  // False for checkpoints written before checksums existed (format version 1) or saved without.
  bool checksummed() const noexcept;
  io::FileIdentity identity() const;
  // The checksum of the file's HDF5 metadata, when it carries a seal; files written by other tools,
  // changed by them after the save, or written before seals existed carry none.
  std::optional<std::uint64_t> seal() const noexcept;
  // Kind, common values, id, and the parameter records as parsed (see params()).
  const CheckpointContents& contents() const noexcept;
  // What ranks compare to know that they opened the same checkpoint: a hash of the id, the seal's
  // digest, the file's size, the version, the kind, the records and the common values, so that two
  // files that share an id (a copy edited by another tool) are never taken for one.
  std::uint64_t fingerprint() const;
  // The parameter records, each checked against the datasets of its blocks (keys, shapes, one
  // dtype); a contradiction is Errc::not_a_checkpoint naming the record.
  const std::vector<ParamRecord>& params() const;
  // Every tensor dataset, in key order. Headers are read on first use.
  const std::vector<Dataset>& datasets() const;
  // Objects at the root that are not tensors (groups, datasets with a null dataspace or an
  // unsupported element type) with the reason they are skipped. A scalar dataset is a tensor of
  // global shape [].
  const std::vector<std::pair<std::string, std::string>>& skipped() const;
  // Throws Errc::missing_key, or Errc::not_a_checkpoint for a skipped object.
  const Dataset& dataset(std::string_view key) const;
  // The slabs a dataset was saved in, checked to tile it exactly (empty in version 1).
  std::vector<Slab> slabs(const Dataset& dataset) const;

  // Reads `box` of the dataset into `dst` (box rows of box width, the dataset's dtype).
  void read(const Dataset& dataset, const Box& box, MutTensorView dst, ReadOptions options = {}) const;
  // The same for the slab at `offset` with extent `count`.
  void read(const Dataset& dataset, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
            MutTensorView dst, ReadOptions options = {}) const;

  // Rows `box` of the dataset (whole rows) as a tensor of `shape` over the checkpoint file itself:
  // host memory backed by a private mapping of the file (a write to it copies the page and never
  // reaches the file), every row checked against its checksum over the mapped pages when
  // options.verify (Errc::corrupt). Nothing when those bytes do not lie in the file as the tensor's
  // rows lie in memory (a chunked, filtered or external dataset, elements not aligned, the
  // hyperslab method, a read around the page cache): read() them into memory instead. The mapping
  // lives as long as the last tensor over it, past the reader. Errc::replaced when the file's size
  // changed since the open, or when it was cut short under the reader's mapping while its pages
  // were brought in or its rows checked (the library reads mapped bytes only under io::run_guarded:
  // a lost page is an error there, never SIGBUS). After the call, a file truncated by someone else
  // while a tensor is over it makes access to the lost pages fail with SIGBUS outside the library
  // (io::copy_guarded and the library's saves report it as Errc::replaced), as for any mapping; one
  // written in place changes what the tensor shows where it was not written (the library's saves
  // replace a file, never rewrite it).
  std::optional<SharedBuffer> map(const Dataset& dataset, const Box& box, Extents shape, ReadOptions options = {}) const;
  // The same for a tensor joined from parts in order (a fused weight's blocks, each whole rows of
  // its own dataset of `dtype`): mapped one after another where each starts on a page of the file
  // and all but the last fill whole pages; nothing otherwise.
  std::optional<SharedBuffer> map(std::span<const MapPart> parts, DType dtype, Extents shape,
                                  ReadOptions options = {}) const;
  // Several tensors, each mapped as map() maps it (nothing for one that cannot be), their rows
  // checked in one pass in file order: a thread brings the pages in (MADV_POPULATE_READ, so the
  // kernel reads ahead as for any mapping) while the calling thread checks the rows behind it, others
  // helping where it falls behind, so the disk does not wait between tensors. The first mismatch in file order is the error;
  // nothing is returned then. Unchecked tensors (options.verify off) are left to fault in as used.
  std::vector<std::optional<SharedBuffer>> map_all(std::span<const MapRequest> requests, ReadOptions options = {}) const;

 private:
  std::unique_ptr<ReaderState> impl_;
};

}  // namespace shardckpt
