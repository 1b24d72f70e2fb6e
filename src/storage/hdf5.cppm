// shardckpt.storage:hdf5 (an implementation partition: never installed, never imported by an
// interface, so that no consumer needs HDF5's headers): the thin, checked layer over HDF5's C API. Every identifier has an owner that closes
// it with the right function; every call's result is checked and HDF5's error stack becomes an
// Error{Errc::hdf5} that names the file, the key and the operation, with HDF5's major and minor
// messages. HDF5 reaches the disk only through a Channel: a virtual file driver over one open
// io::File, so that metadata and data of one open come from one file, and so that a failed write
// never reaches HDF5 (which cannot close a file whose writes failed, and then crashes at exit):
// the channel records the failure and keeps the bytes, HDF5 closes cleanly, and the caller throws.
// Attributes are read only after their type class, rank and size are checked.
module;
#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>
module shardckpt.storage:hdf5;
import shardckpt.core;
import shardckpt.layout;
import :file;

namespace shardckpt::hdf5 {

// Where an HDF5 call happened, for the error message.
struct Where {
  const std::filesystem::path& file;
  std::string_view key;
  std::string_view op;
};

// Throws Error{code} with the operation, key, file and the innermost entries of HDF5's error stack.
[[noreturn]] void fail(const Where& w, Errc code = Errc::hdf5);

template <class T>
T check(T result, const Where& w, Errc code = Errc::hdf5) {
  if (result < 0) [[unlikely]]
    fail(w, code);
  return result;
}

// Owns one HDF5 identifier and closes it with the function of its kind. The destructor ignores a
// failed close (it runs while unwinding); a path that wrote through the object calls close().
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer closer) : id_(id), close_(closer) {}
  Hid(Hid&& o) noexcept;
  Hid& operator=(Hid&& o) noexcept;
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  ~Hid();
  hid_t get() const noexcept { return id_; }
  explicit operator bool() const noexcept { return id_ >= 0; }
  void close(const Where& w);

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

Hid owned(hid_t id, Hid::Closer closer, const Where& w, Errc code = Errc::hdf5);

// How the bytes HDF5 reads are checked before HDF5 sees them (a reader's seal, :seal):
// read() fills `dst` with the `n` bytes at `address` (zeros past the end of the file) or throws.
class ReadCheck {
 public:
  virtual ~ReadCheck() = default;
  virtual void read(const io::File& file, std::uint64_t address, void* dst, std::size_t n) const = 0;
};

// The file HDF5 reads and writes through. Reads that fail make the HDF5 call fail; writes that fail
// are recorded (failure()) and their metadata bytes kept, so that HDF5 still sees what it wrote.
// With a ReadCheck, every read HDF5 makes goes through it: bytes that fail the check never reach
// HDF5's parser.
class Channel {
 public:
  explicit Channel(io::File& file [[clang::lifetimebound]]) : file_(&file) {}
  Channel(io::File& file [[clang::lifetimebound]], const ReadCheck& check [[clang::lifetimebound]])
      : file_(&file), check_(&check) {}
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  io::File& file() const noexcept [[clang::lifetimebound]] { return *file_; }
  const ReadCheck* read_check() const noexcept { return check_; }
  // The first write error, if any: the caller throws it once HDF5 has closed the file.
  const std::optional<Error>& failure() const noexcept [[clang::lifetimebound]] { return failure_; }
  void throw_if_failed() const;
  // The last read error, for the message of the HDF5 call it made fail.
  const std::optional<Error>& read_failure() const noexcept [[clang::lifetimebound]] { return read_failure_; }

  // Called by the driver only.
  void record_write_failure(Error e);
  void record_read_failure(Error e) { read_failure_ = std::move(e); }
  void keep(std::uint64_t address, const void* bytes, std::size_t n);
  void overlay(std::uint64_t address, void* bytes, std::size_t n) const;

 private:
  io::File* file_;
  const ReadCheck* check_ = nullptr;
  std::optional<Error> failure_;
  std::optional<Error> read_failure_;
  std::map<std::uint64_t, std::vector<std::byte>> kept_;  // metadata whose write failed, by address
};

// Creates or opens the HDF5 file of `channel`, with the library's file access properties: the newest
// file format both HDF5 1.10 and h5py read (HDF5's metadata checksums then cover object headers and
// links), objects closed with the file, no HDF5 file locks (the save's phases order all access).
// HDF5 is given a fixed label, never the file's path: it opens nothing by name, and a path of any
// length or depth is never resolved by it. A file opened read-only gets small metadata caches and no
// chunk cache (raw data is read past HDF5), so that many open readers stay small. `metadata_bytes`
// is about how much metadata the new file will hold: HDF5 keeps its metadata in blocks of that size
// (at least its default, 2 KiB), so that it lies together instead of between the tensors' data.
Hid create_file(Channel& channel, std::uint64_t metadata_bytes = 0);
Hid open_file(Channel& channel, bool writable, Errc code);
// Closes a file opened for writing, then throws the channel's first write failure, if any.
void close_written(Hid& file, Channel& channel, std::string_view op);

// ---- types ------------------------------------------------------------------------------------------

// The HDF5 type the library stores `t` as: little-endian, derived from its DTypeInfo.
Hid type_of(DType t);
// The dtype an HDF5 type holds, if it is one shardckpt reads (any byte order).
std::optional<DType> dtype_of(hid_t type);
// True when the file's bytes are exactly the library's in-memory layout of `t`.
bool stored_exactly(hid_t type, DType t);

// ---- objects ----------------------------------------------------------------------------------------

// A group whose attributes are stored densely (any number, any size).
Hid create_group(hid_t parent, const char* name, const Where& w);
// Names of the links of a group, in name order.
std::vector<std::string> link_names(hid_t group, const Where& w);
bool link_exists(hid_t parent, const char* name, const Where& w);
// True when `name` (one component) is a hard link of `parent`: soft and external links are never
// followed (an external link would make HDF5 open another file by name).
bool hard_link_exists(hid_t parent, const char* name, const Where& w);
// What link `name` of `parent` is when it is not a hard link, with where it points ("a soft link to
// '/y'", "an external link to '/x' in the file 'sibling.h5'"), read without following it; nullopt
// for a hard link. The file's bytes appear as printable text.
std::optional<std::string> link_kind(hid_t parent, const char* name, const Where& w);
// Text of a file in a message: printable ASCII as it is, other bytes as \xHH.
std::string printable(std::string_view text);
// The object type of a link (H5O_TYPE_GROUP, H5O_TYPE_DATASET...).
H5O_type_t object_type(hid_t parent, const char* name, const Where& w);

// ---- attributes ---------------------------------------------------------------------------------------

void write_attr(hid_t obj, const char* name, std::int64_t v, const Where& w);
void write_attr(hid_t obj, const char* name, double v, const Where& w);
void write_attr(hid_t obj, const char* name, std::string_view v, const Where& w);
void write_attr(hid_t obj, const char* name, const CommonValue& v, const Where& w);
// A 2-D int64 attribute of `rows` rows of `cols` values (1-D when cols == 0).
void write_attr(hid_t obj, const char* name, std::span<const std::int64_t> values, std::size_t cols, const Where& w);

bool has_attr(hid_t obj, const char* name, const Where& w);
// Each reader checks class, rank and size before reading and throws Error{refusal} naming the
// attribute otherwise: integers and floats must be one value, strings one string (fixed or
// variable length, any size), arrays of the rank asked for.
std::int64_t read_int(hid_t obj, const char* name, const Where& w, Errc refusal);
std::string read_string(hid_t obj, const char* name, const Where& w, Errc refusal);
CommonValue read_value(hid_t obj, const char* name, const Where& w, Errc refusal);
// An int64 array of `cols` columns (1-D when cols == 0); at most `max_values` values.
std::vector<std::int64_t> read_ints(hid_t obj, const char* name, std::size_t cols, std::size_t max_values,
                                    const Where& w, Errc refusal);
// Calls fn(name) for every attribute of `obj` in name order, in one pass.
void for_each_attr(hid_t obj, const Where& w, const std::function<void(const char*)>& fn);

// ---- datasets ---------------------------------------------------------------------------------------

// A dataset's shape, checked: rank 0..32 (0: a scalar, one element), every dim and the element count
// fit int64; a null dataspace (no element at all) is `refusal`.
std::vector<std::int64_t> shape_of(hid_t dataset, const Where& w, Errc refusal);
// Whether a dataset has a null dataspace (h5py's Empty): no value, not even a scalar one.
bool null_dataspace(hid_t dataset, const Where& w, Errc refusal);

// Reads or writes the box `box` (rows x flattened trailing elements, any column range) of a dataset
// of `shape` (a scalar's box is its one element: the whole dataspace is selected). Memory holds the
// box's rows `mem_row_elems` elements apart, each starting `mem_col` elements in (packed:
// mem_row_elems = box width, mem_col = 0).
void read_box(hid_t dataset, DType dtype, std::span<const std::int64_t> shape, const Box& box, void* mem,
              std::int64_t mem_row_elems, std::int64_t mem_col, const Where& w);
void write_box(hid_t dataset, DType dtype, std::span<const std::int64_t> shape, const Box& box, const void* mem,
               const Where& w);

}  // namespace shardckpt::hdf5
