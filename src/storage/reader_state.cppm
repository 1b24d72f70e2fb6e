// shardckpt.storage:reader_state (implementation partition): what an open CheckpointReader holds, for
// the units that implement it (reader.cpp: the open, the metadata, the headers; reader_data.cpp:
// where the bytes are, the slab tables, checked reads). Nothing in it is trusted before the open
// has checked it.
module;
#include <hdf5.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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

namespace shardckpt {

struct FileMapping;  // a private mapping of the whole file (reader_map.cpp), shared by the tensors over it

struct ReaderState {
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

  std::filesystem::path path;
  io::Directory dir;  // the checkpoint's directory, where external files are opened
  io::File file;
  // Bulk reads of `file` through the page cache, and (opened on first use, under the mutex) around it.
  std::optional<io::BulkReader> cached, uncached;
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

  mutable std::mutex mutex;                         // guards everything below
  std::map<std::string, Entry, std::less<>> index;  // the datasets looked at so far
  std::map<std::string, External, std::less<>> externals;
  std::optional<std::vector<Dataset>> all;
  std::optional<std::vector<std::pair<std::string, std::string>>> skipped;
  std::optional<std::vector<ParamRecord>> checked_params;
  std::shared_ptr<FileMapping> mapping;  // made by the first map()

  [[noreturn]] void refuse(std::string_view why) const {
    throw Error(Errc::not_a_checkpoint, cat(path.string(), " is not a shardckpt checkpoint: ", why));
  }
  void open(const std::filesystem::path& p);
  hdf5::Hid group(hid_t parent, const char* name, std::string_view shown, const hdf5::Where& w) const;
  Entry& entry(std::string_view key);
  void read_header(const std::string& name, Entry& e) const;
  const Dataset& info(std::string_view key);
  void read_storage(hid_t set, const std::string& name, Entry& e, const hdf5::Where& w) const;
  External& external(const std::string& name);
  const std::vector<RawRegion>& regions_for(Entry& e);
  const std::vector<Slab>& slabs_for(Entry& e);
  void read_checksums(std::int64_t first, std::int64_t n, std::uint64_t* out) const;
  void read_unchecked(const Dataset& d, Entry& e, const Box& box, std::byte* mem, std::int64_t mem_row_elems,
                      std::int64_t mem_col, const ReadOptions& options);
  void read_checked(const Dataset& d, Entry& e, const Slab& s, const Box& sub, const Box& box, std::byte* out,
                    const ReadOptions& options);
  void read_metadata();
  void read_checksum_table(hid_t meta, const hdf5::Where& w);
};


}  // namespace shardckpt
