module;
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* meta_group = "_shardckpt";
constexpr const char* common_group = "_shardckpt/common";

// ---- HDF5 errors and handles --------------------------------------------------------------------

// HDF5 prints its error stack to stderr unless told not to; the stack is per thread.
void quiet_hdf5() {
  thread_local bool done = false;
  if (!done) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    done = true;
  }
}

// The innermost few entries of HDF5's error stack, with major and minor messages, then cleared.
std::string hdf5_stack() {
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

// Where an HDF5 call happened, for the error message.
struct Where {
  const fs::path& file;
  std::string_view key;
  std::string_view op;
};

[[noreturn]] void fail_hdf5(const Where& w, Errc code = Errc::hdf5) {
  throw Error(code, cat("HDF5 could not ", w.op, w.key.empty() ? "" : " of key ", w.key, " in ", w.file.string(), ": ",
                        hdf5_stack()));
}

template <class T>
T check(T result, const Where& w) {
  if (result < 0) fail_hdf5(w);
  return result;
}

// Owns one HDF5 identifier and closes it with the function of its kind.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer close) : id_(id), close_(close) {}
  Hid(Hid&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), close_(o.close_) {}
  Hid& operator=(Hid&& o) noexcept {
    Hid(std::move(o)).swap(*this);
    return *this;
  }
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  ~Hid() {
    if (id_ >= 0) close_(id_);
  }
  hid_t get() const noexcept { return id_; }
  void swap(Hid& o) noexcept {
    std::swap(id_, o.id_);
    std::swap(close_, o.close_);
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

Hid owned(hid_t id, Hid::Closer close, const Where& w) { return Hid(check(id, w), close); }

// Owns a POSIX file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }

 private:
  int fd_ = -1;
};

[[noreturn]] void fail_os(std::string_view op, const fs::path& file, int err = errno) {
  throw Error(Errc::io, cat("could not ", op, " ", file.string(), ": ", std::strerror(err)));
}

Fd open_fd(const fs::path& file, int flags) {
  const int fd = ::open(file.c_str(), flags | O_CLOEXEC);
  if (fd < 0) fail_os("open", file);
  return Fd(fd);
}

void sync_fd(const Fd& fd, const fs::path& file) {
  if (::fsync(fd.get()) != 0) fail_os("flush to disk", file);
}

void sync_path(const fs::path& file, int flags) { sync_fd(open_fd(file, flags), file); }

// ---- types ----------------------------------------------------------------------------------------

// The HDF5 type the library stores `t` as (little-endian; bf16 as a custom 16-bit float).
Hid h5_type(DType t) {
  const Where w{fs::path(), "", "build a datatype"};
  auto copy = [&](hid_t base) { return owned(H5Tcopy(base), H5Tclose, w); };
  auto half = [&](std::size_t mantissa, std::size_t exponent, std::size_t bias) {
    Hid h = copy(H5T_IEEE_F32LE);
    check(H5Tset_fields(h.get(), 15, mantissa, exponent, 0, mantissa), w);
    check(H5Tset_ebias(h.get(), bias), w);
    check(H5Tset_size(h.get(), 2), w);
    return h;
  };
  switch (t) {
    case DType::bf16:
      return half(7, 8, 127);
    case DType::f16:
      return half(10, 5, 15);
    case DType::f32:
      return copy(H5T_IEEE_F32LE);
    case DType::f64:
      return copy(H5T_IEEE_F64LE);
    case DType::i8:
      return copy(H5T_STD_I8LE);
    case DType::i16:
      return copy(H5T_STD_I16LE);
    case DType::i32:
      return copy(H5T_STD_I32LE);
    case DType::i64:
      return copy(H5T_STD_I64LE);
    case DType::u8:
      return copy(H5T_STD_U8LE);
    case DType::u16:
      return copy(H5T_STD_U16LE);
    case DType::u32:
      return copy(H5T_STD_U32LE);
    case DType::u64:
      return copy(H5T_STD_U64LE);
  }
  throw Error(Errc::invalid_argument, "unknown dtype");
}

std::optional<DType> dtype_of_h5(hid_t t) {
  const std::size_t size = H5Tget_size(t);
  switch (H5Tget_class(t)) {
    case H5T_FLOAT:
      if (size == 2) {
        const std::size_t bias = H5Tget_ebias(t);
        if (bias == 127) return DType::bf16;
        if (bias == 15) return DType::f16;
        return std::nullopt;
      }
      if (size == 4) return DType::f32;
      if (size == 8) return DType::f64;
      return std::nullopt;
    case H5T_INTEGER: {
      const bool is_signed = H5Tget_sign(t) == H5T_SGN_2;
      switch (size) {
        case 1:
          return is_signed ? DType::i8 : DType::u8;
        case 2:
          return is_signed ? DType::i16 : DType::u16;
        case 4:
          return is_signed ? DType::i32 : DType::u32;
        case 8:
          return is_signed ? DType::i64 : DType::u64;
        default:
          return std::nullopt;
      }
    }
    default:
      return std::nullopt;
  }
}

std::vector<hsize_t> to_hsize(std::span<const std::int64_t> v) { return {v.begin(), v.end()}; }

Hid file_access() {
  const Where w{fs::path(), "", "create file access properties"};
  Hid fapl = owned(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, w);
  check(H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_STRONG), w);
  // The 1.8 object format at least: it stores attributes densely, without the 64 KiB cap that
  // would limit the parameter records of a large model.
  check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST), w);
  return fapl;
}

// A group whose attributes are always stored densely (any size).
Hid create_group(hid_t file, const char* name, const Where& w) {
  Hid gcpl = owned(H5Pcreate(H5P_GROUP_CREATE), H5Pclose, w);
  check(H5Pset_attr_phase_change(gcpl.get(), 0, 0), w);
  return owned(H5Gcreate2(file, name, H5P_DEFAULT, gcpl.get(), H5P_DEFAULT), H5Gclose, w);
}

Hid open_file(const fs::path& file, unsigned flags, Errc code) {
  quiet_hdf5();
  Hid fapl = file_access();
  const hid_t id = H5Fopen(file.c_str(), flags, fapl.get());
  if (id < 0) fail_hdf5({file, "", "open the file"}, code);
  return Hid(id, H5Fclose);
}

// ---- attributes -------------------------------------------------------------------------------------

void write_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* data, hsize_t n, bool scalar,
                const Where& w) {
  Hid space = owned(scalar ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &n, nullptr), H5Sclose, w);
  Hid attr = owned(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, w);
  check(H5Awrite(attr.get(), mem_type, data), w);
}

void write_attr(hid_t obj, const char* name, std::int64_t v, const Where& w) {
  write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, 1, true, w);
}
void write_attr(hid_t obj, const char* name, double v, const Where& w) {
  write_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v, 1, true, w);
}
void write_attr(hid_t obj, const char* name, std::span<const std::int64_t> v, const Where& w) {
  write_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, v.data(), v.size(), false, w);
}
void write_attr(hid_t obj, const char* name, std::string_view v, const Where& w) {
  Hid type = owned(H5Tcopy(H5T_C_S1), H5Tclose, w);
  check(H5Tset_size(type.get(), std::max<std::size_t>(v.size(), 1)), w);
  check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), w);
  std::string padded(v);
  padded.resize(std::max<std::size_t>(v.size(), 1), '\0');
  write_attr(obj, name, type.get(), type.get(), padded.data(), 1, true, w);
}

bool has_attr(hid_t obj, const char* name, const Where& w) { return check(H5Aexists(obj, name), w) > 0; }

// Reads a scalar or 1-D attribute of class integer, float or fixed-length string.
CommonValue read_attr(hid_t obj, const char* name, const Where& w) {
  Hid attr = owned(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose, w);
  Hid type = owned(H5Aget_type(attr.get()), H5Tclose, w);
  switch (H5Tget_class(type.get())) {
    case H5T_INTEGER: {
      std::int64_t v = 0;
      check(H5Aread(attr.get(), H5T_NATIVE_INT64, &v), w);
      return v;
    }
    case H5T_FLOAT: {
      double v = 0;
      check(H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &v), w);
      return v;
    }
    case H5T_STRING: {
      if (H5Tis_variable_str(type.get()) > 0) {  // as h5py writes strings
        Hid mem = owned(H5Tcopy(H5T_C_S1), H5Tclose, w);
        check(H5Tset_size(mem.get(), H5T_VARIABLE), w);
        check(H5Tset_cset(mem.get(), H5Tget_cset(type.get())), w);  // h5py writes UTF-8
        char* text = nullptr;
        check(H5Aread(attr.get(), mem.get(), &text), w);
        std::string v = text ? text : "";
        H5free_memory(text);
        return v;
      }
      std::string v(H5Tget_size(type.get()), '\0');
      check(H5Aread(attr.get(), type.get(), v.data()), w);
      v.resize(std::strlen(v.c_str()));
      return v;
    }
    default:
      break;
  }
  throw Error(Errc::not_a_checkpoint,
              cat("attribute ", name, " of ", w.file.string(), " has a type shardckpt does not read"));
}

std::vector<std::int64_t> read_i64s(hid_t obj, const char* name, const Where& w) {
  Hid attr = owned(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose, w);
  Hid space = owned(H5Aget_space(attr.get()), H5Sclose, w);
  std::vector<std::int64_t> v(static_cast<std::size_t>(check(H5Sget_simple_extent_npoints(space.get()), w)));
  check(H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()), w);
  return v;
}

// ---- metadata --------------------------------------------------------------------------------------

json params_json(const std::vector<ParamRecord>& params) {
  json out = json::array();
  for (const ParamRecord& p : params) {
    json blocks = json::array();
    for (const Section& s : p.blocks) blocks.push_back({{"name", s.name}, {"rows", s.rows}});
    out.push_back({{"key", p.key}, {"tp_axis", tp_axis_name(p.tp_axis)}, {"blocks", blocks}, {"trailing", p.trailing}});
  }
  return out;
}

std::vector<ParamRecord> params_from_json(const json& in) {
  std::vector<ParamRecord> out;
  for (const json& p : in) {
    ParamRecord r{p.at("key").get<std::string>(),
                  parse_tp_axis(p.at("tp_axis").get<std::string>()),
                  {},
                  p.at("trailing").get<std::vector<std::int64_t>>()};
    for (const json& b : p.at("blocks"))
      r.blocks.push_back({b.at("name").get<std::string>(), b.at("rows").get<std::int64_t>()});
    out.push_back(std::move(r));
  }
  return out;
}

void require_key(std::string_view key) {
  require(!key.empty() && key.find('/') == std::string_view::npos && key != "." && key[0] != '_',
          Errc::invalid_argument, "key '", key,
          "' cannot name a dataset: it must be non-empty, contain no '/' and not start with '_'");
}

// Checks a slab against its dataset and the caller's tensor; returns the slab's footprint.
Box check_slab(const DatasetInfo& d, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
               DType dtype, std::size_t bytes) {
  require(dtype == d.dtype, Errc::dtype_mismatch, "key ", d.key, ": the dataset holds ", dtype_name(d.dtype),
          " but the tensor is ", dtype_name(dtype));
  const Box box =
      footprint(Claim{d.key, d.dtype, d.shape, {offset.begin(), offset.end()}, {count.begin(), count.end()}, 0, true});
  const std::size_t n = static_cast<std::size_t>(box.rows.size() * box.cols.size()) * dtype_size(d.dtype);
  require(n == bytes, Errc::shape_mismatch, "key ", d.key, ": a slab of ", n, " bytes does not match a tensor of ",
          bytes, " bytes");
  return box;
}

// Moves whole byte ranges despite short transfers and signals; `transfer` is pread or pwrite.
template <class Transfer, class Ptr>
void transfer_all(Transfer transfer, int fd, Ptr p, std::size_t n, std::uint64_t off, const fs::path& file,
                  std::string_view what) {
  while (n > 0) {
    const ssize_t done = transfer(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30), static_cast<off_t>(off));
    if (done < 0 && errno == EINTR) continue;
    if (done < 0) fail_os(what, file);
    if (done == 0)
      throw Error(Errc::not_a_checkpoint, cat("could not ", what, " ", file.string(), ": the file ends at byte ", off));
    p += done;
    n -= static_cast<std::size_t>(done);
    off += static_cast<std::uint64_t>(done);
  }
}

// Moves a slab between memory (its rows packed) and the file, extent by extent: one transfer where
// the slab's rows and the extent's rows are the same bytes wide, else one per row.
template <class Transfer, class Ptr>
void transfer_slab(Transfer transfer, int fd, Ptr p, const DatasetInfo& d, const Box& slab, const fs::path& file,
                   std::string_view what) {
  const auto es = static_cast<std::int64_t>(dtype_size(d.dtype));
  const std::int64_t mem_stride = slab.cols.size() * es;
  for (const Extent& e : d.extents) {
    const Box hit = slab.intersect(e.box);
    if (hit.empty()) continue;
    const std::int64_t file_stride = e.box.cols.size() * es, run = hit.cols.size() * es;
    const std::uint64_t at =
        e.address +
        static_cast<std::uint64_t>(
            ((hit.rows.begin - e.box.rows.begin) * e.box.cols.size() + hit.cols.begin - e.box.cols.begin) * es);
    const Ptr mem = p + ((hit.rows.begin - slab.rows.begin) * slab.cols.size() + hit.cols.begin - slab.cols.begin) * es;
    if (run == file_stride && run == mem_stride) {
      transfer_all(transfer, fd, mem, static_cast<std::size_t>(run * hit.rows.size()), at, file, what);
      continue;
    }
    for (std::int64_t r = 0; r < hit.rows.size(); ++r)
      transfer_all(transfer, fd, mem + r * mem_stride, static_cast<std::size_t>(run),
                   at + static_cast<std::uint64_t>(r * file_stride), file, what);
  }
}

// Chunk lists longer than this (small chunks written by other tools) are read through HDF5.
constexpr hsize_t max_direct_chunks = 1 << 16;

// Where the raw data of an open dataset lies, when the direct path may use it: stored unfiltered in
// exactly the library's type, allocated in full, split (if chunked) along dims 0 and 1 only.
std::vector<Extent> extents_of(hid_t set, hid_t type, const std::vector<std::int64_t>& shape, DType dtype,
                               const Where& w) {
  const Box whole =
      footprint(Claim{std::string(w.key), dtype, shape, std::vector<std::int64_t>(shape.size(), 0), shape, 0, true});
  if (whole.empty() || H5Tequal(type, h5_type(dtype).get()) <= 0) return {};
  Hid dcpl = owned(H5Dget_create_plist(set), H5Pclose, w);
  std::vector<Extent> out;
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout == H5D_CONTIGUOUS) {
    const haddr_t addr = H5Dget_offset(set);
    H5Eclear2(H5E_DEFAULT);  // an unallocated dataset has no address: not an error here
    if (addr != HADDR_UNDEF) out.push_back({whole, addr});
    return out;
  }
  if (layout != H5D_CHUNKED || check(H5Pget_nfilters(dcpl.get()), w) != 0) return {};
  const std::size_t rank = shape.size();
  std::vector<hsize_t> dims(rank);
  check(H5Pget_chunk(dcpl.get(), static_cast<int>(rank), dims.data()), w);
  std::int64_t inner = 1;
  for (std::size_t d = 2; d < rank; ++d) {
    if (static_cast<std::int64_t>(dims[d]) != shape[d]) return {};
    inner *= shape[d];
  }
  const std::int64_t chunk_cols = (rank > 1 ? static_cast<std::int64_t>(dims[1]) : 1) * inner;
  const auto chunk_bytes = static_cast<hsize_t>(static_cast<std::int64_t>(dims[0]) * chunk_cols) * dtype_size(dtype);
  Hid space = owned(H5Dget_space(set), H5Sclose, w);
  hsize_t chunks = 0;
  check(H5Dget_num_chunks(set, space.get(), &chunks), w);
  if (chunks > max_direct_chunks) return {};
  std::int64_t covered = 0;
  std::vector<hsize_t> offset(rank);
  for (hsize_t i = 0; i < chunks; ++i) {
    unsigned filters = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    check(H5Dget_chunk_info(set, space.get(), i, offset.data(), &filters, &addr, &size), w);
    if (addr == HADDR_UNDEF || size != chunk_bytes) return {};
    const auto row = static_cast<std::int64_t>(offset[0]);
    const std::int64_t col = rank > 1 ? static_cast<std::int64_t>(offset[1]) * inner : 0;
    const Box box{{row, row + static_cast<std::int64_t>(dims[0])}, {col, col + chunk_cols}};
    const Box mine = box.intersect(whole);
    covered += mine.rows.size() * mine.cols.size();
    out.push_back({box, addr});
  }
  // Chunks never written are not allocated: then part of the data has no address.
  if (covered != whole.rows.size() * whole.cols.size()) return {};
  return out;
}

// The HDF5 selections of a slab: the hyperslab in the dataset's file space, the packed rows in
// memory, and the library's type for the dataset's dtype (so HDF5 converts nothing it need not).
struct SlabSpaces {
  Hid file, memory, type;
};

SlabSpaces slab_spaces(hid_t set, DType dtype, std::span<const std::int64_t> offset,
                       std::span<const std::int64_t> count, const Where& w) {
  SlabSpaces s{owned(H5Dget_space(set), H5Sclose, w), {}, h5_type(dtype)};
  const auto start = to_hsize(offset), extent = to_hsize(count);
  check(H5Sselect_hyperslab(s.file.get(), H5S_SELECT_SET, start.data(), nullptr, extent.data(), nullptr), w);
  const auto n = static_cast<hsize_t>(element_count(count));
  s.memory = owned(H5Screate_simple(1, &n, nullptr), H5Sclose, w);
  return s;
}

}  // namespace

// ---- public -------------------------------------------------------------------------------------------

ParamRecord record_of(const ParamSpec& spec) {
  return {spec.key, spec.tp_axis, global_sections(spec), global_trailing(spec)};
}

ParamSpec spec_at_tp(const ParamRecord& r, int tp) { return param_at_tp(r.key, r.blocks, r.trailing, r.tp_axis, tp); }

fs::path partial_path(const fs::path& path) { return fs::path(path.string() + ".partial"); }

std::vector<DatasetInfo> create_skeleton(const fs::path& path, std::span<const DatasetSpec> datasets,
                                         const CheckpointContents& contents) {
  quiet_hdf5();
  const Where w{path, "", "create the checkpoint"};
  Hid fapl = file_access();
  Hid file = owned(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose, w);
  {
    Hid meta = create_group(file.get(), meta_group, w);
    write_attr(meta.get(), "format", std::string_view("shardckpt"), w);
    write_attr(meta.get(), "format_version", std::int64_t{format_version}, w);
    write_attr(meta.get(), "kind", std::string_view(contents.kind == CheckpointKind::global ? "global" : "local"), w);
    write_attr(meta.get(), "params", std::string_view(params_json(contents.params).dump()), w);
    Hid common = create_group(file.get(), common_group, w);
    for (const auto& [key, value] : contents.common) {
      require_key(key);
      std::visit([&](const auto& v) { write_attr(common.get(), key.c_str(), v, w); }, value);
    }
  }
  std::vector<DatasetInfo> out;
  out.reserve(datasets.size());
  for (const DatasetSpec& d : datasets) {
    require_key(d.key);
    const Where dw{path, d.key, "create the dataset"};
    // Allocated now and never filled: every byte of a dataset has a fixed file address before any
    // rank writes, and HDF5 spends no time writing fill values that pieces overwrite.
    Hid dcpl = owned(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, dw);
    if (d.chunk.empty()) {
      check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), dw);
    } else {
      const auto chunk = to_hsize(d.chunk);
      check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()), dw);
    }
    check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY), dw);
    check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), dw);
    const auto dims = to_hsize(d.shape);
    Hid space = owned(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose, dw);
    Hid type = h5_type(d.dtype);
    Hid set =
        owned(H5Dcreate2(file.get(), d.key.c_str(), type.get(), space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
              H5Dclose, dw);
    if (d.placement) {
      write_attr(set.get(), "global_shape", std::span<const std::int64_t>(d.placement->global_shape), dw);
      write_attr(set.get(), "global_offset", std::span<const std::int64_t>(d.placement->global_offset), dw);
    }
    if (d.placeholder) write_attr(set.get(), "placeholder", std::int64_t{1}, dw);
    out.push_back(
        {d.key, d.dtype, d.shape, extents_of(set.get(), type.get(), d.shape, d.dtype, dw), d.placement, d.placeholder});
  }
  check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), w);
  return out;
}

struct PieceWriter::Impl {
  fs::path path;
  IoMethod method;
  Fd fd;     // direct path
  Hid file;  // hyperslab path
  std::map<std::string, Hid, std::less<>> sets;
};

PieceWriter::PieceWriter(const fs::path& path, IoMethod method) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->method = method;
  if (method == IoMethod::direct)
    impl_->fd = open_fd(path, O_WRONLY);
  else
    impl_->file = open_file(path, H5F_ACC_RDWR, Errc::hdf5);
}
PieceWriter::PieceWriter(PieceWriter&&) noexcept = default;
PieceWriter& PieceWriter::operator=(PieceWriter&&) noexcept = default;
PieceWriter::~PieceWriter() = default;

void PieceWriter::write(const DatasetInfo& d, std::span<const std::int64_t> offset, std::span<const std::int64_t> count,
                        TensorView src) {
  const Box box = check_slab(d, offset, count, src.dtype(), src.bytes());
  if (src.empty()) return;
  Impl& m = *impl_;
  if (m.method == IoMethod::direct) {
    require(!d.extents.empty(), Errc::invalid_argument, "key ", d.key,
            ": the direct path needs a dataset whose raw data it can address");
    transfer_slab(::pwrite, m.fd.get(), src.data(), d, box, m.path, "write");
    return;
  }
  const Where w{m.path, d.key, "write a piece"};
  auto it = m.sets.find(d.key);
  if (it == m.sets.end())
    it = m.sets.emplace(d.key, owned(H5Dopen2(m.file.get(), d.key.c_str(), H5P_DEFAULT), H5Dclose, w)).first;
  const SlabSpaces s = slab_spaces(it->second.get(), d.dtype, offset, count, w);
  check(H5Dwrite(it->second.get(), s.type.get(), s.memory.get(), s.file.get(), H5P_DEFAULT, src.data()), w);
}

void PieceWriter::finish() {
  Impl& m = *impl_;
  if (m.method == IoMethod::direct) {
    sync_fd(m.fd, m.path);
    m.fd = Fd();
    return;
  }
  m.sets.clear();
  check(H5Fflush(m.file.get(), H5F_SCOPE_GLOBAL), Where{m.path, "", "flush"});
  m.file = Hid();
  sync_path(m.path, O_RDONLY);
}

void mark_complete(const fs::path& path) {
  {
    const Where w{path, "", "mark the checkpoint complete"};
    Hid file = open_file(path, H5F_ACC_RDWR, Errc::hdf5);
    Hid meta = owned(H5Gopen2(file.get(), meta_group, H5P_DEFAULT), H5Gclose, w);
    write_attr(meta.get(), "complete", std::int64_t{1}, w);
    check(H5Fflush(file.get(), H5F_SCOPE_GLOBAL), w);
  }
  sync_path(path, O_RDONLY);
}

void commit(const fs::path& partial, const fs::path& path) {
  std::error_code ec;
  fs::rename(partial, path, ec);
  if (ec) throw Error(Errc::io, cat("could not rename ", partial.string(), " to ", path.string(), ": ", ec.message()));
  // The rename is durable only once the directory entry is.
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  sync_path(dir, O_RDONLY | O_DIRECTORY);
}

void discard(const fs::path& partial) noexcept {
  std::error_code ec;
  fs::remove(partial, ec);
}

// Dataset headers are read on first use: a rank that loads a few keys of a checkpoint of thousands
// opens only those (in-process ranks share HDF5's one lock).
struct CheckpointReader::Impl {
  struct Entry {
    bool read = false;
    std::optional<DatasetInfo> info;
  };
  fs::path path;
  Hid file;
  Fd fd;
  std::uint64_t file_size = 0;
  CheckpointContents contents;
  std::mutex mutex;  // guards index and all
  std::map<std::string, Entry, std::less<>> index;
  std::optional<std::vector<DatasetInfo>> all;

  std::optional<DatasetInfo> header(const std::string& name) const;
  const DatasetInfo* find(std::string_view key);
};

CheckpointReader::CheckpointReader(const fs::path& path) : impl_(std::make_unique<Impl>()) {
  quiet_hdf5();
  Impl& m = *impl_;
  m.path = path;
  auto refuse = [&](std::string_view why) {
    throw Error(Errc::not_a_checkpoint, cat(path.string(), " is not a shardckpt checkpoint: ", why));
  };
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) refuse("no such file");
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    refuse("not an HDF5 file");
  }
  m.file = open_file(path, H5F_ACC_RDONLY, Errc::not_a_checkpoint);
  const Where w{path, "", "read the checkpoint metadata"};
  if (check(H5Lexists(m.file.get(), meta_group, H5P_DEFAULT), w) <= 0) refuse("it has no /_shardckpt group");
  Hid meta = owned(H5Gopen2(m.file.get(), meta_group, H5P_DEFAULT), H5Gclose, w);
  for (const char* name : {"format", "format_version", "kind", "params"})
    if (!has_attr(meta.get(), name, w)) refuse(cat("/_shardckpt has no attribute ", name));
  if (read_attr(meta.get(), "format", w) != CommonValue(std::string("shardckpt")))
    refuse("/_shardckpt names another format");
  const CommonValue version_attr = read_attr(meta.get(), "format_version", w);
  if (!std::holds_alternative<std::int64_t>(version_attr)) refuse("its format version is not an integer");
  const auto version = std::get<std::int64_t>(version_attr);
  if (version > format_version)
    refuse(cat("format version ", version, " is newer than this library's ", format_version));
  if (!has_attr(meta.get(), "complete", w)) refuse("the save that wrote it did not finish");
  const CommonValue kind = read_attr(meta.get(), "kind", w);
  if (kind != CommonValue(std::string("global")) && kind != CommonValue(std::string("local"))) refuse("unknown kind");
  m.contents.kind = std::get<std::string>(kind) == "local" ? CheckpointKind::local : CheckpointKind::global;
  try {
    m.contents.params = params_from_json(json::parse(std::get<std::string>(read_attr(meta.get(), "params", w))));
  } catch (const std::exception& e) {  // not JSON, not a string, or fields missing
    refuse(cat("its parameter records do not parse: ", e.what()));
  }
  if (check(H5Lexists(m.file.get(), common_group, H5P_DEFAULT), w) <= 0) refuse("it has no /_shardckpt/common group");
  {
    Hid common = owned(H5Gopen2(m.file.get(), common_group, H5P_DEFAULT), H5Gclose, w);
    H5O_info_t info;
    check(H5Oget_info2(common.get(), &info, H5O_INFO_NUM_ATTRS), w);
    for (hsize_t i = 0; i < info.num_attrs; ++i) {
      char name[1024];
      check(H5Aget_name_by_idx(common.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT), w);
      m.contents.common.emplace(name, read_attr(common.get(), name, w));
    }
  }
  // Every dataset at the root, with its dtype, shape and (when the direct path may use them) extents.
  std::vector<std::string> names;
  check(H5Literate(
            m.file.get(), H5_INDEX_NAME, H5_ITER_INC, nullptr,
            [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->push_back(name);
              return 0;
            },
            &names),
        w);
  m.fd = open_fd(path, O_RDONLY);
  struct stat st{};
  if (::fstat(m.fd.get(), &st) != 0) fail_os("inspect", path);
  m.file_size = static_cast<std::uint64_t>(st.st_size);
  for (std::string& name : names)
    if (name != meta_group) m.index.try_emplace(std::move(name));
}

// Reads one dataset's header: nullopt for an object that is not a dataset (a group someone added).
std::optional<DatasetInfo> CheckpointReader::Impl::header(const std::string& name) const {
  const Where dw{path, name, "read the dataset header"};
  const auto refuse = [&](std::string_view why) {
    throw Error(Errc::not_a_checkpoint, cat(path.string(), " is not a shardckpt checkpoint: dataset ", name, " ", why));
  };
  H5O_info_t object;
  check(H5Oget_info_by_name2(file.get(), name.c_str(), &object, H5O_INFO_BASIC, H5P_DEFAULT), dw);
  if (object.type != H5O_TYPE_DATASET) return std::nullopt;
  Hid set = owned(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose, dw);
  Hid type = owned(H5Dget_type(set.get()), H5Tclose, dw);
  const auto dtype = dtype_of_h5(type.get());
  if (!dtype) refuse("has a type shardckpt does not store");
  Hid space = owned(H5Dget_space(set.get()), H5Sclose, dw);
  const int rank = check(H5Sget_simple_extent_ndims(space.get()), dw);
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  check(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), dw);
  DatasetInfo info{name, *dtype, {dims.begin(), dims.end()}, {}, std::nullopt, false};
  info.extents = extents_of(set.get(), type.get(), info.shape, *dtype, dw);
  for (const Extent& e : info.extents) {
    const std::uint64_t end =
        e.address + static_cast<std::uint64_t>(e.box.rows.size() * e.box.cols.size()) * dtype_size(*dtype);
    if (end > file_size) refuse(cat("ends at byte ", end, " but the file has ", file_size, " (truncated)"));
  }
  if (has_attr(set.get(), "global_offset", dw))
    info.placement =
        PiecePlacement{read_i64s(set.get(), "global_shape", dw), read_i64s(set.get(), "global_offset", dw)};
  info.placeholder = has_attr(set.get(), "placeholder", dw);
  return info;
}

const DatasetInfo* CheckpointReader::Impl::find(std::string_view key) {
  const auto it = index.find(key);
  if (it == index.end()) return nullptr;
  Entry& e = it->second;
  if (!e.read) {
    e.info = header(it->first);
    e.read = true;
  }
  return e.info ? &*e.info : nullptr;
}

CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

const fs::path& CheckpointReader::path() const noexcept { return impl_->path; }
const CheckpointContents& CheckpointReader::contents() const noexcept { return impl_->contents; }
const std::vector<DatasetInfo>& CheckpointReader::datasets() const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  if (!m.all) {
    std::vector<DatasetInfo> all;
    for (const auto& [name, entry] : m.index)
      if (const DatasetInfo* d = m.find(name)) all.push_back(*d);
    m.all = std::move(all);
  }
  return *m.all;
}

const DatasetInfo& CheckpointReader::dataset(std::string_view key) const {
  Impl& m = *impl_;
  const std::lock_guard lock(m.mutex);
  const DatasetInfo* d = m.find(key);
  require(d != nullptr, Errc::missing_key, "key ", key, " is not in ", m.path.string());
  return *d;
}

void CheckpointReader::read(const DatasetInfo& d, std::span<const std::int64_t> offset,
                            std::span<const std::int64_t> count, MutTensorView dst, IoMethod method) const {
  const Box box = check_slab(d, offset, count, dst.dtype(), dst.bytes());
  if (dst.empty()) return;
  const Impl& m = *impl_;
  if (method == IoMethod::direct && !d.extents.empty()) {
    transfer_slab(::pread, m.fd.get(), dst.data(), d, box, m.path, "read");
    return;
  }
  // Datasets the direct path cannot address (filtered, small chunks, another byte order) go through HDF5.
  const Where w{m.path, d.key, "read a piece"};
  Hid set = owned(H5Dopen2(m.file.get(), d.key.c_str(), H5P_DEFAULT), H5Dclose, w);
  const SlabSpaces s = slab_spaces(set.get(), d.dtype, offset, count, w);
  check(H5Dread(set.get(), s.type.get(), s.memory.get(), s.file.get(), H5P_DEFAULT, dst.data()), w);
}

}  // namespace shardckpt
