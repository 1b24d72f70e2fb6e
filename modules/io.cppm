// shardckpt.io: raw positional file I/O, the only place where checkpoint bytes meet the operating
// system (HDF5's own reads and writes come through here too, see shardckpt.hdf5). A File owns one
// descriptor; every transfer moves all of its bytes or throws Error{Errc::io} naming the file, the
// operation and the byte range, whatever the cause (EIO, ENOSPC, EFBIG, a short write that makes no
// progress). SIGXFSZ is ignored from the first write on, so that a file-size limit is an EFBIG
// error, not the death of the process. This module knows nothing of HDF5, tensors or ranks.
module;
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
export module shardckpt.io;
import shardckpt.core;

export namespace shardckpt::io {

// Which file an open descriptor is: two opens of the same path can reach different files when the
// path is replaced in between.
struct FileIdentity {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

class File {
 public:
  // Throw Errc::io naming the path when the file cannot be opened.
  static File open_read(const std::filesystem::path& path);
  static File open_write(const std::filesystem::path& path);
  // Opens an existing file for reading and writing.
  static File open_update(const std::filesystem::path& path);
  // Creates (truncating) a file for reading and writing.
  static File create(const std::filesystem::path& path);

  File() = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const noexcept { return fd_ >= 0; }
  int descriptor() const noexcept { return fd_; }
  const std::filesystem::path& path() const noexcept [[clang::lifetimebound]] { return path_; }
  FileIdentity identity() const;
  std::uint64_t size() const;

  // All `n` bytes at `offset`. A read that meets the end of the file throws Errc::not_a_checkpoint
  // (the file is shorter than its metadata says); pread_upto returns how many bytes exist instead.
  void pread_all(void* dst, std::size_t n, std::uint64_t offset) const;
  std::size_t pread_upto(void* dst, std::size_t n, std::uint64_t offset) const;
  void pwrite_all(const void* src, std::size_t n, std::uint64_t offset);
  void truncate(std::uint64_t size);
  // Flushes the file's data and metadata to stable storage.
  void sync();
  // Closes now and reports what close() reports (NFS, for one, reports write errors there).
  void close();

 private:
  File(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::filesystem::path path_;
};

// Whether bulk reads may bypass the page cache.
enum class PageCache { bypass, use };

// Bulk reads of an open File that bypass the page cache (O_DIRECT) where the file system allows
// it. Ranks that read scattered slabs of one file through the page cache can get a fraction of the
// bandwidth of one sequential reader (docs/performance.md); direct reads of the same slabs do not.
// Bytes land straight in the destination where its address and the file offset are both aligned
// to 4096, else they pass through aligned bounce buffers of 1 MiB (reused, one per concurrent
// caller). Where O_DIRECT is refused (tmpfs, some FUSE file systems), the path now names another
// file, or a direct read fails with EINVAL, reads go through the File's own descriptor instead:
// the same bytes and the same errors as File::pread_all.
class BulkReader {
 public:
  BulkReader(const File& file [[clang::lifetimebound]], PageCache cache);
  BulkReader(const BulkReader&) = delete;
  BulkReader& operator=(const BulkReader&) = delete;
  ~BulkReader();

  // Whether reads bypass the page cache (false once a direct read was refused).
  bool bypasses() const noexcept;
  // All `n` bytes at `offset`, like File::pread_all.
  void read(void* dst, std::size_t n, std::uint64_t offset) const;
  // `count` runs of `run` bytes that follow each other in the file from `offset`, to dst,
  // dst + stride, dst + 2 * stride, ... (rows of a wider tensor).
  void read_runs(std::byte* dst, std::size_t run, std::size_t stride, std::size_t count, std::uint64_t offset) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Bytes read and written through every File of this process so far (all threads, HDF5's own
// transfers included): what the benchmark compares with the bytes a load needed.
struct IoStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
};
IoStats io_stats() noexcept;

// Syncs a directory so that entries created or renamed in it are durable.
void sync_directory(const std::filesystem::path& dir);
// Renames `from` to `to` (atomically replacing `to`), then syncs the directory of `to`.
void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to);
// Removes a file if it exists; never throws.
void remove_quietly(const std::filesystem::path& path) noexcept;
// The file a path names once every symlink on its last component is followed: a save to a link
// replaces the link's target, not the link. Throws Errc::io for a link cycle.
std::filesystem::path follow_links(const std::filesystem::path& path);
// 128 random bits as 32 hex digits (getrandom): a checkpoint's unique id.
std::string random_id();

}  // namespace shardckpt::io
