// shardckpt.storage:file: where checkpoint bytes meet the operating system, and the only place
// (HDF5's own reads and writes come through here too, see the :hdf5 partition). A File owns one
// descriptor; every transfer moves all of its bytes or throws Error{Errc::io} naming the file, the
// operation and the byte range, whatever the cause (EIO, ENOSPC, EFBIG, a short write that makes no
// progress). SIGXFSZ is ignored from the first write on, so that a file-size limit is an EFBIG
// error, not the death of the process. Names are hostile: a Directory is held open and names are
// resolved against it, a TemporaryFile is created under a name nobody can plant, and files are opened
// without following links or blocking where someone else could have put something at the name.
// This partition knows nothing of HDF5, tensors or ranks.
module;
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
export module shardckpt.storage:file;
import shardckpt.core;

export namespace shardckpt::io {

// Which file an open descriptor is: two opens of the same path can reach different files when the
// path is replaced in between.
struct FileIdentity {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

// A file's identity as processes of one job compare it. Device numbers are per machine (the
// clients of a network file system number its mount each their own way), so a process on another
// machine (`machine`: this boot of this host) compares the inode alone.
struct SharedIdentity {
  FileIdentity file;
  std::uint64_t machine = 0;
};
SharedIdentity shared_identity(const FileIdentity& file);
// This boot of this machine, as a number (its kernel's boot id and host name, hashed; 0 where they
// cannot be read): processes that give the same nonzero number share one kernel, and so one page
// cache, where a sync of a file by any of them syncs what every one of them wrote to it.
std::uint64_t this_machine();
bool same_file(const SharedIdentity& a, const SharedIdentity& b) noexcept;

// What a directory entry or an open descriptor is.
enum class FileKind : std::uint8_t { regular, directory, symlink, fifo, socket, character_device, block_device, other };
std::string_view file_kind_name(FileKind kind) noexcept;

struct FileStatus {
  FileKind kind = FileKind::other;
  FileIdentity identity;
  std::uint32_t mode = 0;  // permission bits (07777)
  std::uint32_t owner = 0, group = 0;
  std::uint64_t links = 0;
  std::uint64_t size = 0;
};

// An open file descriptor and the path it was opened as (for messages): the one owner of a
// descriptor, which File and Directory hold. Move-only; closes on destruction (close() reports
// what close reports).
class Descriptor {
 public:
  Descriptor() = default;
  // Owns `fd` (which must be open), named `path` in messages.
  Descriptor(int fd, std::filesystem::path path) noexcept : fd_(fd), path_(std::move(path)) {}
  Descriptor(Descriptor&& other) noexcept;
  Descriptor& operator=(Descriptor&& other) noexcept;
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  ~Descriptor();

  bool is_open() const noexcept { return fd_ >= 0; }
  int get() const noexcept { return fd_; }
  const std::filesystem::path& path() const noexcept [[clang::lifetimebound]] { return path_; }
  // What the descriptor refers to (fstat); Errc::io naming the path.
  FileStatus status() const;
  // Flushes what it refers to (data and metadata, or a directory's entries) to stable storage.
  void sync() const;
  void close();

 private:
  int fd_ = -1;
  std::filesystem::path path_;
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

  bool is_open() const noexcept { return fd_.is_open(); }
  int descriptor() const noexcept { return fd_.get(); }
  const std::filesystem::path& path() const noexcept [[clang::lifetimebound]] { return fd_.path(); }
  FileIdentity identity() const;
  std::uint64_t size() const;
  FileStatus status() const;
  // Sets the permission bits (fchmod), and the group where the user may set it (a group the user is
  // not in is left as it is).
  void set_mode(std::uint32_t mode);
  void try_set_group(std::uint32_t group) noexcept;

  // All `n` bytes at `offset`. A read that meets the end of the file throws Errc::not_a_checkpoint
  // (the file is shorter than its metadata says); pread_upto returns how many bytes exist instead.
  void pread_all(void* dst, std::size_t n, std::uint64_t offset) const;
  std::size_t pread_upto(void* dst, std::size_t n, std::uint64_t offset) const;
  void pwrite_all(const void* src, std::size_t n, std::uint64_t offset);
  // Asks the kernel to start writing the dirty pages of bytes [begin, end) to disk now, without
  // waiting for them (sync_file_range(SYNC_FILE_RANGE_WRITE)): a later sync() then waits for less.
  // Only a hint: it reports nothing (a write error shows at the sync), and where the file system
  // lacks it, nothing happens.
  void start_writeback(std::uint64_t begin, std::uint64_t end) const noexcept;
  void truncate(std::uint64_t size);
  // Flushes the file's data and metadata to stable storage.
  void sync() { fd_.sync(); }
  // Closes now and reports what close() reports (NFS, for one, reports write errors there).
  void close() { fd_.close(); }

 private:
  friend class Directory;
  friend class TemporaryFile;
  explicit File(Descriptor fd) noexcept : fd_(std::move(fd)) {}
  Descriptor fd_;
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

// A directory held open: names in it are resolved against its descriptor, so that nobody can
// swap the directory for another (a link planted at its path) between two uses of it.
class Directory {
 public:
  // Throws Errc::io naming the path (an empty path is the working directory).
  static Directory open(const std::filesystem::path& dir);
  Directory() = default;

  int descriptor() const noexcept { return fd_.get(); }
  const std::filesystem::path& path() const noexcept [[clang::lifetimebound]] { return fd_.path(); }
  // `name` in it, for messages.
  std::filesystem::path operator/(std::string_view name) const { return fd_.path() / std::string(name); }
  // What `name` is, without following a link on it; nothing when there is no such entry.
  std::optional<FileStatus> status(std::string_view name) const;
  // What the directory itself is.
  FileStatus status() const;
  // Opens the plain name `name` for reading without following a link on it and without blocking
  // (a FIFO or a device is not waited on), and accepts only a regular file: anything else is
  // Error{refusal} naming the file and what it is. A name with a '/' is refused too.
  File open_regular(std::string_view name, Errc refusal) const;
  // Flushes the directory's entries (created, renamed) to stable storage.
  void sync() const { fd_.sync(); }

 private:
  explicit Directory(Descriptor fd) noexcept : fd_(std::move(fd)) {}
  Descriptor fd_;
};

// True for a name that can only name an entry of the directory it is looked up in: not empty, not
// "." or "..", without '/' or NUL.
bool plain_name(std::string_view name) noexcept;

// Where a save puts a file: the path with every link on its last component followed (a save to a
// link replaces the link's target), that file's directory held open, and its name in it.
struct Destination {
  Directory dir;
  std::string name;
  std::filesystem::path path;  // the resolved path
  std::string shown;           // the path as given, and the link's target if it is a link, for messages

  // Throws Errc::invalid_argument when the path names something a save must not replace (a
  // directory, FIFO, socket or device), Errc::io when its directory cannot be opened.
  // follow_links=false: a path that is a symbolic link is refused (Errc::invalid_argument), and so is
  // a link planted there later, when the checkpoint replaces it (the rename replaces the name itself).
  static Destination of(const std::filesystem::path& path, bool follow_links = true);
  // The same check against what the name names now.
  void require_replaceable() const;
};

// The name pattern of a save's temporary files: `.<name>.<32 hex digits>.partial` beside the file
// `<name>` being saved. is_temporary_name(n) tells whether a name follows it, temporary_name_for(n)
// makes a fresh one.
bool is_temporary_name(std::string_view name) noexcept;
std::string temporary_name_for(std::string_view name);

// A file a save creates and fills before it replaces its destination: under a fresh unpredictable
// name in the destination's directory, created exclusively (O_EXCL, no link followed, mode 0600)
// and checked (fstat) to be a regular file with one link, owned by this user, so that nothing
// another user planted is ever written through or committed. Until commit() the destination is
// untouched; a temporary file that is never committed is removed (if its name still names it).
class TemporaryFile {
 public:
  static TemporaryFile create(Destination dest);
  // Another rank's view of the file that `creator` made: its name opened for writing in `dir`
  // (without following a link), checked to be the same file (same_file), regular, with one link and
  // owned by this user. Throws Errc::io otherwise.
  static File open_created(const std::filesystem::path& dir, std::string_view name, const SharedIdentity& creator);

  TemporaryFile(TemporaryFile&& other) noexcept;
  TemporaryFile& operator=(TemporaryFile&& other) noexcept;
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  ~TemporaryFile();

  File& file() noexcept [[clang::lifetimebound]] { return file_; }
  const Destination& destination() const noexcept [[clang::lifetimebound]] { return dest_; }
  const std::string& name() const noexcept [[clang::lifetimebound]] { return name_; }
  SharedIdentity identity() const { return shared_identity(identity_); }

  // Gives the file the mode and group of the file it replaces (or new_file_mode() for a new one),
  // without syncing: a caller that syncs the file afterwards (a seal) spares commit() its own sync.
  void take_destination_mode();
  // Gives the file the destination's mode and group (unless take_destination_mode() did, and the file
  // was synced since: then it is not synced again), checks that its name still names this file and
  // that the destination is still a regular file or absent, renames it over the destination and
  // syncs the directory. Throws Errc::io or invalid_argument, leaving the destination as it was.
  void commit();
  // Removes the file, if its name still names it, and closes it; never throws.
  void discard() noexcept;

 private:
  TemporaryFile(Destination dest, File file, std::string name, FileIdentity identity)
      : dest_(std::move(dest)), file_(std::move(file)), name_(std::move(name)), identity_(identity) {}
  Destination dest_;
  File file_;
  std::string name_;
  FileIdentity identity_;
  bool pending_ = true;
  bool mode_taken_ = false;  // take_destination_mode() ran (the caller syncs the file after it)
};

// Mappings of files, and reads of their bytes that a file cut short cannot turn into a signal.
// A page of a file mapping past the file's end (another program truncated the file under it,
// private copies of pages included: the kernel drops those too) raises SIGBUS when touched. A
// MappedRange registers a mapping; the first one installs, once for the process, a SIGBUS handler
// that ends a guarded call (run_guarded, copy_guarded) whose thread faulted on a registered page,
// so that the caller reports Errc::replaced naming the file. A fault anywhere else, or outside a
// guarded call (code that touches a tensor over the file after the load returned), goes on to the
// handler that was there before (by default the death of the process by SIGBUS); a fault on a
// registered page first writes one line to stderr naming the file that was cut short.
class MappedRange {
 public:
  MappedRange() = default;
  // Registers [at, at + bytes), a mapping of `path`. False from registered() when the process holds
  // too many registered mappings already (the caller must not map then).
  MappedRange(const void* at, std::size_t bytes, const std::filesystem::path& path) noexcept;
  MappedRange(const MappedRange&) = delete;
  MappedRange& operator=(const MappedRange&) = delete;
  ~MappedRange();
  bool registered() const noexcept { return slot_ >= 0; }

 private:
  int slot_ = -1;
};

// Runs fn(context), ended early by a SIGBUS on a page of a registered mapping in this thread:
// returns the address that faulted (0 when fn ran to its end). fn may be left midway: it must hold
// nothing that needs destroying and leave nothing half done that matters once it is abandoned.
std::uintptr_t run_guarded(void (*fn)(void*), void* context) noexcept;
// The registered file mapped at `address` ("another program's file" when none is any more).
std::string mapped_file_at(std::uintptr_t address);
// Whether any of [p, p + n) lies in a registered mapping.
bool in_mapping(const void* p, std::size_t n) noexcept;
// memcpy of `n` bytes from src, which may lie in a registered mapping: Errc::replaced naming the
// file when its pages were lost (the file was cut short under the mapping).
void copy_guarded(void* dst, const void* src, std::size_t n);

// The mode a new file gets: 0666 without the bits of this process's umask (read from the kernel;
// 0600 where it cannot be read).
std::uint32_t new_file_mode();

// The file a path names once every symlink on its last component is followed: a save to a link
// replaces the link's target, not the link. Throws Errc::io for a link cycle.
std::filesystem::path follow_links(const std::filesystem::path& path);
// Makes sure descriptors 0, 1 and 2 are open (on /dev/null where they are not), so that no file this
// process opens becomes its standard input, output or error. For programs, before they open anything.
void ensure_standard_descriptors() noexcept;
// 128 random bits as 32 hex digits (getrandom): a checkpoint's unique id.
std::string random_id();

}  // namespace shardckpt::io
