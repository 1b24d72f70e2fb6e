module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;

namespace shardckpt::hdf5 {
namespace {

namespace fs = std::filesystem;

// HDF5 prints its error stack to stderr unless told not to; the setting is per thread.
void quiet() {
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

// The innermost few entries of HDF5's error stack, with major and minor messages, then cleared.
std::string stack_text() {
  std::string out;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned n, const H5E_error2_t* e, void* data) -> herr_t {
        auto& s = *static_cast<std::string*>(data);
        if (n >= 3) return 0;
        char maj[160] = "", min[160] = "";
        H5Eget_msg(e->maj_num, nullptr, maj, sizeof maj);
        H5Eget_msg(e->min_num, nullptr, min, sizeof min);
        s += cat(n ? "; " : "", e->func_name, ": ", e->desc ? e->desc : "", " [", maj, " / ", min, "]");
        return 0;
      },
      &out);
  H5Eclear2(H5E_DEFAULT);
  return out.empty() ? "no detail from HDF5" : out;
}

// ---- the virtual file driver over a Channel ---------------------------------------------------------

struct DriverInfo {
  Channel* channel;
};

// HDF5's file struct comes first: HDF5 hands the driver back this pointer.
struct DriverFile {
  H5FD_t pub;
  Channel* channel;
  haddr_t eoa;
  haddr_t eof;
};

constexpr haddr_t max_address = (haddr_t{1} << (8 * sizeof(off_t) - 1)) - 1;

DriverFile* as_file(H5FD_t* f) { return reinterpret_cast<DriverFile*>(f); }
const DriverFile* as_file(const H5FD_t* f) { return reinterpret_cast<const DriverFile*>(f); }

void* info_copy(const void* info) {
  void* out = std::malloc(sizeof(DriverInfo));
  if (out) std::memcpy(out, info, sizeof(DriverInfo));
  return out;
}

herr_t info_free(void* info) {
  std::free(info);
  return 0;
}

void* info_get(H5FD_t* f) {
  const DriverInfo info{as_file(f)->channel};
  return info_copy(&info);
}

H5FD_t* driver_open(const char*, unsigned, hid_t fapl, haddr_t maxaddr) {
  const auto* info = static_cast<const DriverInfo*>(H5Pget_driver_info(fapl));
  if (!info || maxaddr == 0 || maxaddr == HADDR_UNDEF || maxaddr > max_address) return nullptr;
  auto* f = static_cast<DriverFile*>(std::calloc(1, sizeof(DriverFile)));
  if (!f) return nullptr;
  f->channel = info->channel;
  try {
    f->eof = f->channel->file().size();
  } catch (Error& e) {
    f->channel->record_read_failure(std::move(e));
    std::free(f);
    return nullptr;
  }
  return &f->pub;
}

herr_t driver_close(H5FD_t* f) {
  std::free(as_file(f));
  return 0;
}

// Two opens are the same file only if they share a channel: HDF5 must never share one reader's
// open file with another's, which may be a different file under the same name.
int driver_cmp(const H5FD_t* a, const H5FD_t* b) {
  const auto x = reinterpret_cast<std::uintptr_t>(as_file(a)->channel);
  const auto y = reinterpret_cast<std::uintptr_t>(as_file(b)->channel);
  return x < y ? -1 : x > y ? 1 : 0;
}

// Not H5FD_FEAT_POSIX_COMPAT_HANDLE: with it HDF5 resolves the file's name as a path (the name is
// only a label here: the file is already open, and may be a memfd or a replaced path).
herr_t driver_query(const H5FD_t*, unsigned long* flags) {
  *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA | H5FD_FEAT_DATA_SIEVE |
           H5FD_FEAT_AGGREGATE_SMALLDATA;
  return 0;
}

haddr_t driver_get_eoa(const H5FD_t* f, H5FD_mem_t) { return as_file(f)->eoa; }

herr_t driver_set_eoa(H5FD_t* f, H5FD_mem_t, haddr_t addr) {
  as_file(f)->eoa = addr;
  return 0;
}

haddr_t driver_get_eof(const H5FD_t* f, H5FD_mem_t) { return as_file(f)->eof; }

herr_t driver_get_handle(H5FD_t* f, hid_t, void** handle) {
  static thread_local int fd;
  fd = as_file(f)->channel->file().descriptor();
  *handle = &fd;
  return 0;
}

// The failure of the last read the driver made on this thread, for the HDF5 call it made fail: an
// Error of the library (a changed file, an I/O error) is what that call reports, not HDF5's stack.
thread_local std::optional<Error> failed_read;

herr_t driver_read(H5FD_t* f, H5FD_mem_t, hid_t, haddr_t addr, size_t size, void* buf) {
  DriverFile& file = *as_file(f);
  if (addr == HADDR_UNDEF || addr > max_address || size > max_address - addr) return -1;
  try {
    if (const ReadCheck* check = file.channel->read_check()) {
      check->read(file.channel->file(), addr, buf, size);
    } else {
      // Bytes past the end of the file read as zeros, as with HDF5's own POSIX driver.
      const std::size_t got = file.channel->file().pread_upto(buf, size, addr);
      std::memset(static_cast<std::byte*>(buf) + got, 0, size - got);
    }
  } catch (Error& e) {
    failed_read = e;
    file.channel->record_read_failure(std::move(e));
    return -1;
  }
  file.channel->overlay(addr, buf, size);
  return 0;
}

// Never fails: a failed write is recorded on the channel, and metadata bytes are kept so that
// HDF5 reads back what it wrote and can close the file.
herr_t driver_write(H5FD_t* f, H5FD_mem_t type, hid_t, haddr_t addr, size_t size, const void* buf) {
  DriverFile& file = *as_file(f);
  if (addr == HADDR_UNDEF || addr > max_address || size > max_address - addr) return -1;
  Channel& ch = *file.channel;
  if (!ch.failure()) {
    try {
      ch.file().pwrite_all(buf, size, addr);
    } catch (Error& e) {
      ch.record_write_failure(std::move(e));
    }
  }
  if (ch.failure() && type != H5FD_MEM_DRAW) ch.keep(addr, buf, size);
  file.eof = std::max<haddr_t>(file.eof, addr + size);
  return 0;
}

// HDF5 sizes the file to its end of allocation when it closes or flushes it.
herr_t driver_truncate(H5FD_t* f, hid_t, hbool_t) {
  DriverFile& file = *as_file(f);
  if (file.eoa == file.eof) return 0;
  Channel& ch = *file.channel;
  if (!ch.failure()) {
    try {
      ch.file().truncate(file.eoa);
    } catch (Error& e) {
      ch.record_write_failure(std::move(e));
    }
  }
  file.eof = file.eoa;
  return 0;
}

herr_t driver_lock(H5FD_t*, hbool_t) { return 0; }
herr_t driver_unlock(H5FD_t*) { return 0; }

const H5FD_class_t driver_class = {
    "shardckpt_channel",
    max_address,
    H5F_CLOSE_WEAK,
    nullptr,  // terminate
    nullptr,  // sb_size
    nullptr,  // sb_encode
    nullptr,  // sb_decode
    sizeof(DriverInfo),
    info_get,
    info_copy,
    info_free,
    0,        // dxpl_size
    nullptr,  // dxpl_copy
    nullptr,  // dxpl_free
    driver_open,
    driver_close,
    driver_cmp,
    driver_query,
    nullptr,  // get_type_map
    nullptr,  // alloc
    nullptr,  // free
    driver_get_eoa,
    driver_set_eoa,
    driver_get_eof,
    driver_get_handle,
    driver_read,
    driver_write,
    nullptr,  // flush: the library syncs the descriptor itself
    driver_truncate,
    driver_lock,
    driver_unlock,
    H5FD_FLMAP_DICHOTOMY,
};

hid_t driver_id() {
  static hid_t id = H5I_INVALID_HID;
  static std::once_flag once;
  std::call_once(once, [] { id = H5FDregister(&driver_class); });
  return id;
}

// What HDF5 is told a file is called: an absolute label, so that HDF5 never resolves a path (a
// relative name makes it ask for the working directory, which fails below PATH_MAX).
constexpr const char* file_label = "/shardckpt-channel";

// A reader's caches: HDF5's default metadata cache starts at 2 MiB and may grow to 32 MiB per open
// file, and every chunked dataset it reads gets a 1 MiB chunk cache; a reader reads raw data past
// HDF5 and needs only the headers and slab tables of what it reads, each once (512 thread ranks of
// the seed's geometry held 0.9 MiB of HDF5 memory each with a 1 MiB cache).
void small_caches(hid_t fapl, const Where& w) {
  H5AC_cache_config_t config{};
  config.version = H5AC__CURR_CACHE_CONFIG_VERSION;
  check(H5Pget_mdc_config(fapl, &config), w);
  config.set_initial_size = true;
  config.initial_size = std::size_t{64} << 10;
  config.min_size = std::size_t{32} << 10;
  config.max_size = std::size_t{256} << 10;
  check(H5Pset_mdc_config(fapl, &config), w);
  check(H5Pset_cache(fapl, 0, 521, 0, 0.75), w);
}

Hid file_access(Channel& channel, const Where& w) {
  Hid fapl = owned(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, w);
  check(H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG), w);
  // 1.10 file format: checksummed superblock, object headers, links and attribute storage, which
  // h5py 3.7 and the tools of Debian 12 read.
  check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110), w);
  const DriverInfo info{&channel};
  check(H5Pset_driver(fapl.get(), check(driver_id(), w), &info), w);
  return fapl;
}

}  // namespace

void fail(const Where& w, Errc code) {
  const std::string where = cat("HDF5 could not ", w.op, w.key.empty() ? "" : " of key ", w.key, " in ", w.file.string());
  if (std::optional<Error> read = std::exchange(failed_read, std::nullopt)) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(read->code(), cat(where, ": ", read->message()));
  }
  throw Error(code, cat(where, ": ", stack_text()));
}

Hid::Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), close_(o.close_) {}

Hid& Hid::operator=(Hid&& o) noexcept {
  if (this != &o) {
    if (id_ >= 0) close_(id_);
    id_ = std::exchange(o.id_, H5I_INVALID_HID);
    close_ = o.close_;
  }
  return *this;
}

Hid::~Hid() {
  if (id_ >= 0) close_(id_);
}

void Hid::close(const Where& w) {
  const hid_t id = std::exchange(id_, H5I_INVALID_HID);
  if (id >= 0) check(close_(id), w);
}

Hid owned(hid_t id, Hid::Closer closer, const Where& w, Errc code) { return Hid(check(id, w, code), closer); }

void Channel::throw_if_failed() const {
  if (failure_) throw *failure_;
}

void Channel::record_write_failure(Error e) {
  if (!failure_) failure_ = std::move(e);
}

void Channel::keep(std::uint64_t address, const void* bytes, std::size_t n) {
  const auto* b = static_cast<const std::byte*>(bytes);
  // A later write supersedes the parts of earlier ones it covers: apply it over them, then keep it.
  for (auto& [at, kept] : kept_) {
    const std::uint64_t lo = std::max(at, address), hi = std::min(at + kept.size(), address + n);
    if (lo < hi) std::memcpy(kept.data() + (lo - at), b + (lo - address), hi - lo);
  }
  auto& slot = kept_[address];
  if (slot.size() < n) slot.assign(b, b + n);
}

void Channel::overlay(std::uint64_t address, void* bytes, std::size_t n) const {
  auto* b = static_cast<std::byte*>(bytes);
  for (const auto& [at, kept] : kept_) {
    const std::uint64_t lo = std::max(at, address), hi = std::min(at + kept.size(), address + n);
    if (lo < hi) std::memcpy(b + (lo - address), kept.data() + (lo - at), hi - lo);
  }
}

Hid create_file(Channel& channel, std::uint64_t metadata_bytes) {
  quiet();
  const Where w{channel.file().path(), "", "create the file"};
  Hid fapl = file_access(channel, w);
  // Objects of 4 KiB or more (tensor data) start at multiples of 4096 bytes: rows of such multiples
  // then lie aligned for reads that bypass the page cache (io::BulkReader), and a fused weight's
  // blocks can be mapped one after another into one tensor (CheckpointReader::map). At most 4 KiB
  // of padding per such dataset.
  check(H5Pset_alignment(fapl.get(), hsize_t{4} << 10, 4096), w);
  // One block for all the metadata where it is known beforehand: each new block of HDF5's metadata
  // would otherwise land between two tensors (at the end of the file as it grows), and a fused
  // weight's blocks would no longer lie one after another (create_skeleton).
  if (metadata_bytes > 2048) check(H5Pset_meta_block_size(fapl.get(), static_cast<hsize_t>(metadata_bytes)), w);
  return owned(H5Fcreate(file_label, H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose, w);
}

Hid open_file(Channel& channel, bool writable, Errc code) {
  quiet();
  const Where w{channel.file().path(), "", "open the file"};
  Hid fapl = file_access(channel, w);
  if (!writable) small_caches(fapl.get(), w);
  const hid_t id = H5Fopen(file_label, writable ? H5F_ACC_RDWR : H5F_ACC_RDONLY, fapl.get());
  if (id < 0) {
    if (channel.read_failure()) {
      H5Eclear2(H5E_DEFAULT);
      failed_read.reset();
      throw *channel.read_failure();
    }
    fail(w, code);
  }
  return Hid(id, H5Fclose);
}

void close_written(Hid& file, Channel& channel, std::string_view op) {
  if (file) {
    check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), {channel.file().path(), "", op});
    file.close({channel.file().path(), "", op});
  }
  channel.throw_if_failed();
}

}  // namespace shardckpt::hdf5
