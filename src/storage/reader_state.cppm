// shardckpt.storage:reader_state (implementation partition): what an open CheckpointReader holds, for
// the units that implement it (reader.cpp: the open, the metadata, the headers; reader_data.cpp:
// where the bytes are, the slab tables, the two sources, checked reads; reader_map.cpp: tensors
// over the file). Nothing in it is trusted before the open has checked it.
module;
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module shardckpt.storage:reader_state;
import shardckpt.core;
import shardckpt.layout;
import :file;
import :format;
import :reader;
import :hdf5;
import :seal;
import shardckpt.guarded;

namespace shardckpt {

struct FileMapping;  // a private mapping of the whole file (reader_map.cpp), shared by the tensors over it

// A dataset as its header describes it, read once when first asked for (only the datasets a rank
// looks at) and never changed after; what is looked up later is made once, by the first thread that
// asks (Lazy).
struct DatasetEntry {
  struct Header {
    std::optional<Dataset> info;
    std::string skipped;                  // why it is not a tensor
    std::optional<std::string> link;      // what it is when it is a link (not followed): "a soft link to '/y'"
    std::optional<std::string> external;  // the file beside the checkpoint that holds its bytes
    std::uint64_t external_offset = 0;
  };
  struct SlabTable {
    std::vector<Slab> slabs;            // sorted by first row
    std::vector<std::int64_t> reach;    // running maximum of the slabs' end rows
  };

  explicit DatasetEntry(Header h)
      : info(std::move(h.info)),
        skipped(std::move(h.skipped)),
        link(std::move(h.link)),
        external(std::move(h.external)),
        external_offset(h.external_offset) {}

  const std::optional<Dataset> info;
  const std::string skipped;
  const std::optional<std::string> link;
  const std::optional<std::string> external;
  const std::uint64_t external_offset;
  Lazy<std::vector<RawRegion>> regions;  // empty where the raw path cannot address the bytes
  Lazy<SlabTable> slabs;
};

// The two ways the bytes of a box of a dataset reach the caller's rows (row i of the box at mem + i *
// mem_row_elems elements, mem_col elements in), each owning what it reads through; which one reads
// is chosen in one place (ReaderState::read_unchecked).

// By address: the dataset's raw regions in the checkpoint, or in an external file beside it (which
// it opens itself, in the checkpoint's directory: HDF5 never opens it by name), read by its own
// descriptors through the page cache, or around it where asked.
class RawSource {
 public:
  struct External {
    io::File file;
    std::optional<io::BulkReader> bulk;
  };

  RawSource(const std::filesystem::path& path, const io::Directory& dir [[clang::lifetimebound]],
            const io::File& file [[clang::lifetimebound]])
      : path_(path), dir_(dir), file_(file), cached_(file, io::PageCache::use) {}

  void read(const Dataset& d, const DatasetEntry& e, std::span<const RawRegion> regions, const Box& box,
            std::byte* mem, std::int64_t mem_row_elems, std::int64_t mem_col, const ReadOptions& options) const;
  // The external file `name` beside the checkpoint, opened on first use.
  const External& external(const std::string& name) const;

 private:
  std::filesystem::path path_;
  const io::Directory& dir_;
  const io::File& file_;
  io::BulkReader cached_;
  Lazy<std::unique_ptr<io::BulkReader>> uncached_;
  Guarded<std::map<std::string, External, std::less<>>> externals_;
};

// HDF5 hyperslab reads through the reader's open file, for IoMethod::hyperslab and for what the raw
// path cannot address (filtered data, many small chunks, another byte order).
class Hdf5Source {
 public:
  Hdf5Source(const std::filesystem::path& path, hid_t h5) : path_(path), h5_(h5) {}
  void read(const Dataset& d, const Box& box, std::byte* mem, std::int64_t mem_row_elems, std::int64_t mem_col) const;

 private:
  std::filesystem::path path_;
  hid_t h5_;  // ReaderState::h5, which outlives it
};

// What an open CheckpointReader holds. Everything a read may change is a Guarded or a Lazy, so the
// readers of one checkpoint share a const ReaderState on any number of threads.
struct ReaderState {
  using Entry = DatasetEntry;
  // The datasets' names in the file, as tensors or as what they are instead.
  struct Listing {
    std::vector<Dataset> all;
    std::vector<std::pair<std::string, std::string>> skipped;
  };

  std::filesystem::path path;
  io::Directory dir;  // the checkpoint's directory, where external files are opened
  io::File file;
  std::unique_ptr<SealedMetadata> sealed;  // checks every read HDF5 makes (a current seal)
  std::unique_ptr<hdf5::Channel> channel;
  hdf5::Hid h5;
  hdf5::Hid checksums;  // the checksum table (version 2)
  int version = 0;
  bool checksummed = false;
  CheckpointContents contents;
  std::int64_t checksum_count = 0;
  std::optional<std::uint64_t> checksums_address;
  std::uint64_t file_size = 0;
  std::optional<std::uint64_t> seal;
  std::optional<RawSource> raw;     // made once the file is open
  std::optional<Hdf5Source> hdf5;   // made once HDF5 has opened the file

  Guarded<std::map<std::string, Entry, std::less<>>> index;  // the datasets looked at so far
  Lazy<Listing> listing;
  Lazy<std::vector<ParamRecord>> checked_params;
  Lazy<std::shared_ptr<FileMapping>> mapping;  // made by the first map()

  [[noreturn]] void refuse(std::string_view why) const {
    throw Error(Errc::not_a_checkpoint, cat(path.string(), " is not a shardckpt checkpoint: ", why));
  }
  void open(const std::filesystem::path& p);
  hdf5::Hid group(hid_t parent, const char* name, std::string_view shown, const hdf5::Where& w) const;
  const Entry& entry(std::string_view key) const;
  Entry::Header read_header(const std::string& name) const;
  // The entry of a tensor (one lookup): a key that names something else is refused.
  const Entry& tensor_entry(std::string_view key) const;
  const Dataset& info(std::string_view key) const;
  void read_storage(hid_t set, const std::string& name, Entry::Header& e, const hdf5::Where& w) const;
  const std::vector<RawRegion>& regions_for(const Entry& e) const;
  const Entry::SlabTable& slabs_for(const Entry& e) const;
  std::vector<RawRegion> find_regions(const Entry& e) const;
  Entry::SlabTable read_slab_table(const Entry& e) const;
  void read_checksums(std::int64_t first, std::int64_t n, std::uint64_t* out) const;
  void read_unchecked(const Dataset& d, const Entry& e, const Box& box, std::byte* mem, std::int64_t mem_row_elems,
                      std::int64_t mem_col, const ReadOptions& options) const;
  void read_checked(const Dataset& d, const Entry& e, const Slab& s, const Box& sub, const Box& box, std::byte* out,
                    const ReadOptions& options) const;
  void read_metadata();
  void read_checksum_table(hid_t meta, const hdf5::Where& w);
};

}  // namespace shardckpt
