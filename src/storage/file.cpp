module;
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :os;

namespace shardckpt::io {
namespace {
namespace fs = std::filesystem;
}  // namespace

Descriptor::Descriptor(Descriptor&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

Descriptor& Descriptor::operator=(Descriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

Descriptor::~Descriptor() {
  if (fd_ >= 0) ::close(fd_);
}

void Descriptor::sync() const {
  if (::fsync(fd_) != 0) fail("flush to disk", path_, errno);
}

void Descriptor::close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail("close", path_, errno);
}

File File::open_read(const fs::path& path) { return File(Descriptor(open_fd(path, O_RDONLY), path)); }

File File::open_write(const fs::path& path) {
  ignore_sigxfsz();
  return File(Descriptor(open_fd(path, O_WRONLY), path));
}

File File::open_update(const fs::path& path) {
  ignore_sigxfsz();
  return File(Descriptor(open_fd(path, O_RDWR), path));
}

File File::create(const fs::path& path) {
  ignore_sigxfsz();
  return File(Descriptor(open_fd(path, O_RDWR | O_CREAT | O_TRUNC), path));
}

FileIdentity File::identity() const { return fd_.status().identity; }

std::uint64_t File::size() const { return fd_.status().size; }

namespace {

FileKind kind_of(mode_t mode) {
  if (S_ISREG(mode)) return FileKind::regular;
  if (S_ISDIR(mode)) return FileKind::directory;
  if (S_ISLNK(mode)) return FileKind::symlink;
  if (S_ISFIFO(mode)) return FileKind::fifo;
  if (S_ISSOCK(mode)) return FileKind::socket;
  if (S_ISCHR(mode)) return FileKind::character_device;
  if (S_ISBLK(mode)) return FileKind::block_device;
  return FileKind::other;
}

FileStatus status_of(const struct stat& st) {
  return {kind_of(st.st_mode),
          {static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)},
          static_cast<std::uint32_t>(st.st_mode & 07777),
          static_cast<std::uint32_t>(st.st_uid),
          static_cast<std::uint32_t>(st.st_gid),
          static_cast<std::uint64_t>(st.st_nlink),
          static_cast<std::uint64_t>(st.st_size)};
}

}  // namespace

FileStatus Descriptor::status() const {
  struct stat st{};
  if (::fstat(fd_, &st) != 0) fail("inspect", path_, errno);
  return status_of(st);
}

FileStatus File::status() const { return fd_.status(); }

void File::set_mode(std::uint32_t mode) {
  while (::fchmod(fd_.get(), static_cast<mode_t>(mode & 07777)) != 0)
    if (errno != EINTR) fail(cat("set the mode ", std::oct, mode, std::dec, " of"), path(), errno);
}

void File::try_set_group(std::uint32_t group) noexcept { (void)::fchown(fd_.get(), static_cast<uid_t>(-1), group); }

IoStats io_stats() noexcept { return {bytes_read.load(), bytes_written.load()}; }

std::size_t File::pread_upto(void* dst, std::size_t n, std::uint64_t offset) const {
  auto* p = static_cast<std::byte*>(dst);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_.get(), p + done, std::min(n - done, max_transfer), static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_at("read", path(), n, offset, errno);
    if (got == 0) break;
    done += static_cast<std::size_t>(got);
  }
  bytes_read.fetch_add(done, std::memory_order_relaxed);
  return done;
}

void File::pread_all(void* dst, std::size_t n, std::uint64_t offset) const {
  const std::size_t got = pread_upto(dst, n, offset);
  require(got == n, Errc::not_a_checkpoint, path().string(), " ends at byte ", offset + got, " but ", n,
          " bytes are needed at byte ", offset, " (truncated)");
}

void File::start_writeback(std::uint64_t begin, std::uint64_t end) const noexcept {
  if (begin < end && end <= static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()))
    (void)::sync_file_range(descriptor(), static_cast<off_t>(begin), static_cast<off_t>(end - begin),
                            SYNC_FILE_RANGE_WRITE);
}

void File::pwrite_all(const void* src, std::size_t n, std::uint64_t offset) {
  const auto* p = static_cast<const std::byte*>(src);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t put = ::pwrite(fd_.get(), p + done, std::min(n - done, max_transfer), static_cast<off_t>(offset + done));
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail_at("write", path(), n, offset, errno);
    // A write that moves nothing would loop forever; POSIX leaves its cause unsaid (a full device).
    if (put == 0) fail_at("write", path(), n, offset, ENOSPC);
    done += static_cast<std::size_t>(put);
  }
  bytes_written.fetch_add(done, std::memory_order_relaxed);
}

void File::truncate(std::uint64_t size) {
  while (::ftruncate(fd_.get(), static_cast<off_t>(size)) != 0)
    if (errno != EINTR) fail(cat("resize to ", size, " bytes"), path(), errno);
}


// ---- directories, destinations and temporary files ----------------------------------------------

std::string_view file_kind_name(FileKind kind) noexcept {
  switch (kind) {
    case FileKind::regular:
      return "a regular file";
    case FileKind::directory:
      return "a directory";
    case FileKind::symlink:
      return "a symbolic link";
    case FileKind::fifo:
      return "a FIFO";
    case FileKind::socket:
      return "a socket";
    case FileKind::character_device:
      return "a character device";
    case FileKind::block_device:
      return "a block device";
    case FileKind::other:
      break;
  }
  return "not a regular file";
}

// This boot of this machine: the kernel's boot id, hashed (0 where it cannot be read).
std::uint64_t this_machine() {
  static const std::uint64_t id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string text;
    std::getline(in, text);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    text += host;
    return text.empty() ? std::uint64_t{0} : static_cast<std::uint64_t>(XXH3_64bits(text.data(), text.size()));
  }();
  return id;
}


SharedIdentity shared_identity(const FileIdentity& file) { return {file, this_machine()}; }

bool same_file(const SharedIdentity& a, const SharedIdentity& b) noexcept {
  if (a.file.inode != b.file.inode) return false;
  return a.machine != b.machine || a.machine == 0 || a.file.device == b.file.device;
}

bool plain_name(std::string_view name) noexcept {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

Directory Directory::open(const fs::path& dir) {
  const fs::path d = dir.empty() ? fs::path(".") : dir;
  int fd = -1;
  while ((fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (fd < 0) fail("open the directory", d, errno);
  return Directory(Descriptor(fd, d));
}

std::optional<FileStatus> Directory::status(std::string_view name) const {
  struct stat st{};
  const std::string n(name);
  if (::fstatat(fd_.get(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return std::nullopt;
    fail("inspect", *this / name, errno);
  }
  return status_of(st);
}

FileStatus Directory::status() const { return fd_.status(); }

namespace {

// Looks before anything is opened: `name` in the directory `dir` as an O_PATH descriptor, without
// following a link on it. An O_PATH open opens nothing: a FIFO's writer is not released by it, a
// device's driver never sees it, a link is not followed (the descriptor refers to the link itself).
Descriptor look_at(int dir, const std::string& name, const fs::path& shown) {
  int fd = -1;
  while ((fd = ::openat(dir, name.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (fd < 0) fail("open", shown, errno);
  return Descriptor(fd, shown);
}

// Opens for I/O (`flags`) the file that `looked` (look_at of `name` in `dir`) refers to, and no
// other: through /proc/self/fd/N, the kernel's link to the open file, which no rename of `name`
// redirects. Where /proc is not mounted, `name` is opened again, without following a link and
// without blocking, and must be the same file (a file put at the name in between is refused,
// though opened). O_NONBLOCK keeps the open from waiting on a lease; it is cleared again.
Descriptor open_looked_at(const Descriptor& looked, const FileIdentity& id, int dir, const std::string& name, int flags) {
  const std::string proc = cat("/proc/self/fd/", looked.get());
  int fd = -1;
  while ((fd = ::open(proc.c_str(), flags | O_NONBLOCK | O_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (fd < 0 && errno == ENOENT)
    while ((fd = ::openat(dir, name.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)) < 0 && errno == EINTR) {
    }
  if (fd < 0) fail("open", looked.path(), errno);
  Descriptor opened(fd, looked.path());
  require(opened.status().identity == id, Errc::io, looked.path().string(), " was replaced while it was being opened");
  const int now = ::fcntl(fd, F_GETFL);
  if (now >= 0) (void)::fcntl(fd, F_SETFL, now & ~O_NONBLOCK);
  return opened;
}

}  // namespace

File Directory::open_regular(std::string_view name, Errc refusal) const {
  const fs::path shown = *this / name;
  require(plain_name(name), refusal, "'", name, "' is not a plain file name in ", path().string());
  const std::string n(name);
  const Descriptor looked = look_at(fd_.get(), n, shown);
  const FileStatus st = looked.status();
  if (st.kind == FileKind::symlink) throw Error(refusal, cat(shown.string(), " is a symbolic link, which is not followed"));
  require(st.kind == FileKind::regular, refusal, shown.string(), " is ", file_kind_name(st.kind),
          ", not a regular file");
  return File(open_looked_at(looked, st.identity, fd_.get(), n, O_RDONLY));
}


Destination Destination::of(const fs::path& path, bool follow) {
  const fs::path target = follow ? follow_links(path) : path;
  Destination d;
  d.name = target.filename().string();
  require(plain_name(d.name), Errc::invalid_argument, "cannot save to ", path.string(),
          ": it does not name a file in a directory");
  d.dir = Directory::open(target.parent_path());
  d.path = target;
  d.shown = target == path ? path.string() : cat(path.string(), " (a link to ", target.string(), ")");
  if (!follow) {
    const std::optional<FileStatus> st = d.dir.status(d.name);
    require(!st || st->kind != FileKind::symlink, Errc::invalid_argument, "cannot save to ", d.shown,
            ": it is a symbolic link, and this save follows none (the name is fixed, not the user's)");
  }
  d.require_replaceable();
  return d;
}

void Destination::require_replaceable() const {
  const std::optional<FileStatus> st = dir.status(name);
  require(!st || st->kind == FileKind::regular || st->kind == FileKind::symlink, Errc::invalid_argument,
          "cannot save to ", shown, ": it is ", file_kind_name(st ? st->kind : FileKind::other),
          ", and a save replaces only regular files");
}

bool is_temporary_name(std::string_view name) noexcept {
  constexpr std::string_view suffix = ".partial";
  constexpr std::size_t hex = 32;
  if (name.size() < 1 + 1 + 1 + hex + suffix.size() || name[0] != '.' || !name.ends_with(suffix)) return false;
  const std::string_view rest = name.substr(0, name.size() - suffix.size());
  const std::string_view digits = rest.substr(rest.size() - hex);
  return rest[rest.size() - hex - 1] == '.' && digits.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

std::string temporary_name_for(std::string_view name) { return cat(".", name, ".", random_id(), ".partial"); }

namespace {

// Checks what a temporary file's descriptor is: a regular file with one link, owned by this user.
void check_temporary(const File& f) {
  const FileStatus st = f.status();
  require(st.kind == FileKind::regular && st.links == 1 && st.owner == ::geteuid(), Errc::io, "the temporary file ",
          f.path().string(), " is ", file_kind_name(st.kind), " with ", st.links, " links owned by user ", st.owner,
          ", not the file this save created: another user may have planted it");
}

}  // namespace

TemporaryFile TemporaryFile::create(Destination dest) {
  ignore_sigxfsz();
  const std::string name = temporary_name_for(dest.name);
  int fd = -1;
  while ((fd = ::openat(dest.dir.descriptor(), name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                        0600)) < 0 &&
         errno == EINTR) {
  }
  const fs::path shown = dest.dir / name;
  if (fd < 0) fail("create", shown, errno);
  File f(Descriptor(fd, shown));
  const FileIdentity id = f.identity();
  TemporaryFile out(std::move(dest), std::move(f), name, id);
  check_temporary(out.file_);
  return out;
}

File TemporaryFile::open_created(const fs::path& dir, std::string_view name, const SharedIdentity& creator) {
  ignore_sigxfsz();
  require(is_temporary_name(name), Errc::io, "'", name, "' is not the name of a save's temporary file");
  const Directory d = Directory::open(dir);
  const std::string n(name);
  const fs::path shown = d / name;
  // Looked at first: a FIFO or device planted at the name is refused without being opened.
  const Descriptor looked = look_at(d.descriptor(), n, shown);
  const FileStatus st = looked.status();
  require(st.kind == FileKind::regular, Errc::io, "the temporary file ", shown.string(), " is ",
          file_kind_name(st.kind), ", not the file this save created: another user may have planted it");
  File f(open_looked_at(looked, st.identity, d.descriptor(), n, O_RDWR));
  check_temporary(f);
  require(same_file(shared_identity(f.identity()), creator), Errc::io, shown.string(),
          " is not the temporary file rank 0 created: it was replaced");
  return f;
}

TemporaryFile::TemporaryFile(TemporaryFile&& other) noexcept
    : dest_(std::move(other.dest_)),
      file_(std::move(other.file_)),
      name_(std::move(other.name_)),
      identity_(other.identity_),
      pending_(std::exchange(other.pending_, false)),
      mode_taken_(other.mode_taken_) {}

TemporaryFile& TemporaryFile::operator=(TemporaryFile&& other) noexcept {
  if (this != &other) {
    discard();
    dest_ = std::move(other.dest_);
    file_ = std::move(other.file_);
    name_ = std::move(other.name_);
    identity_ = other.identity_;
    pending_ = std::exchange(other.pending_, false);
    mode_taken_ = other.mode_taken_;
  }
  return *this;
}

TemporaryFile::~TemporaryFile() { discard(); }

void TemporaryFile::take_destination_mode() {
  require(pending_, Errc::internal, "the mode taken for a temporary file already committed");
  const std::optional<FileStatus> old = dest_.dir.status(dest_.name);
  if (old && old->kind == FileKind::regular) {
    file_.set_mode(old->mode);
    if (old->group != file_.status().group) file_.try_set_group(old->group);
  } else {
    file_.set_mode(new_file_mode());
  }
  mode_taken_ = true;
}

void TemporaryFile::commit() {
  require(pending_, Errc::internal, "a temporary file committed twice");
  dest_.require_replaceable();
  if (!mode_taken_) {
    take_destination_mode();
    file_.sync();
  }
  const std::optional<FileStatus> mine = dest_.dir.status(name_);
  require(mine && mine->identity == identity_, Errc::io, "cannot commit ", dest_.path.string(), ": ",
          file_.path().string(), " is no longer the file this save wrote (it was removed or replaced)");
  if (::renameat(dest_.dir.descriptor(), name_.c_str(), dest_.dir.descriptor(), dest_.name.c_str()) != 0)
    throw Error(Errc::io, cat("could not rename ", file_.path().string(), " to ", dest_.path.string(), ": ",
                              std::strerror(errno)));
  pending_ = false;
  dest_.dir.sync();
  file_.close();
}

void TemporaryFile::discard() noexcept {
  if (!std::exchange(pending_, false)) return;
  try {
    const std::optional<FileStatus> mine = dest_.dir.status(name_);
    if (mine && mine->identity == identity_) ::unlinkat(dest_.dir.descriptor(), name_.c_str(), 0);
  } catch (const Error&) {
  }
  if (file_.is_open()) {
    try {
      file_.close();
    } catch (const Error&) {
    }
  }
}

std::uint32_t new_file_mode() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.starts_with("Umask:")) {
      const unsigned long mask = std::strtoul(line.c_str() + 6, nullptr, 8);
      return static_cast<std::uint32_t>(0666 & ~mask);
    }
  return 0600;
}

void ensure_standard_descriptors() noexcept {
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int opened = ::open("/dev/null", O_RDWR);
      if (opened >= 0 && opened != fd) {
        ::dup2(opened, fd);
        ::close(opened);
      }
    }
}

fs::path follow_links(const fs::path& path) {
  fs::path p = path;
  for (int hops = 0; hops < 40; ++hops) {
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p;
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) throw Error(Errc::io, cat("could not read the link ", p.string(), ": ", ec.message()));
    p = target.is_absolute() ? target : p.parent_path() / target;
  }
  throw Error(Errc::io, cat("could not follow ", path.string(), ": too many levels of symbolic links"));
}

std::string random_id() {
  unsigned char bits[16];
  std::size_t got = 0;
  while (got < sizeof bits) {
    const ssize_t n = ::getrandom(bits + got, sizeof bits - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(Errc::io, cat("could not draw a checkpoint id: ", std::strerror(errno)));
    got += static_cast<std::size_t>(n);
  }
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bits) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace shardckpt::io
