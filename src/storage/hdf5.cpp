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
}  // namespace

// ---- types ------------------------------------------------------------------------------------------

Hid type_of(DType t) {
  const Where w{fs::path(), "", "build a datatype"};
  const DTypeInfo& d = dtype_info(t);
  const auto copy = [&](hid_t base) { return owned(H5Tcopy(base), H5Tclose, w); };
  switch (d.kind) {
    case NumberKind::signed_integer:
    case NumberKind::unsigned_integer: {
      const bool is_signed = d.kind == NumberKind::signed_integer;
      switch (d.size) {
        case 1:
          return copy(is_signed ? H5T_STD_I8LE : H5T_STD_U8LE);
        case 2:
          return copy(is_signed ? H5T_STD_I16LE : H5T_STD_U16LE);
        case 4:
          return copy(is_signed ? H5T_STD_I32LE : H5T_STD_U32LE);
        default:
          return copy(is_signed ? H5T_STD_I64LE : H5T_STD_U64LE);
      }
    }
    case NumberKind::floating:
      if (d.size == 4) return copy(H5T_IEEE_F32LE);
      if (d.size == 8) return copy(H5T_IEEE_F64LE);
      break;
  }
  // A 16-bit float of the table's layout: fields, bias, then size, in that order (a size smaller
  // than the fields is refused).
  Hid h = copy(H5T_IEEE_F32LE);
  const auto bits = d.size * 8;
  check(H5Tset_fields(h.get(), bits - 1, static_cast<std::size_t>(d.mantissa_bits),
                      static_cast<std::size_t>(d.exponent_bits), 0, static_cast<std::size_t>(d.mantissa_bits)),
        w);
  check(H5Tset_ebias(h.get(), static_cast<std::size_t>(d.exponent_bias)), w);
  check(H5Tset_size(h.get(), d.size), w);
  return h;
}

std::optional<DType> dtype_of(hid_t type) {
  const std::size_t size = H5Tget_size(type);
  const H5T_class_t cls = H5Tget_class(type);
  for (const DTypeInfo& d : dtype_table) {
    if (d.size != size) continue;
    if (d.kind == NumberKind::floating) {
      if (cls != H5T_FLOAT) continue;
      std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
      if (H5Tget_fields(type, &spos, &epos, &esize, &mpos, &msize) < 0) break;
      if (esize == static_cast<std::size_t>(d.exponent_bits) && msize == static_cast<std::size_t>(d.mantissa_bits) &&
          H5Tget_ebias(type) == static_cast<std::size_t>(d.exponent_bias))
        return d.dtype;
    } else if (cls == H5T_INTEGER) {
      const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
      if (is_signed == (d.kind == NumberKind::signed_integer)) return d.dtype;
    }
  }
  H5Eclear2(H5E_DEFAULT);
  return std::nullopt;
}

bool stored_exactly(hid_t type, DType t) {
  Hid ours = type_of(t);
  const htri_t equal = H5Tequal(type, ours.get());
  H5Eclear2(H5E_DEFAULT);
  return equal > 0;
}

// ---- objects ----------------------------------------------------------------------------------------

Hid create_group(hid_t parent, const char* name, const Where& w) {
  Hid gcpl = owned(H5Pcreate(H5P_GROUP_CREATE), H5Pclose, w);
  check(H5Pset_attr_phase_change(gcpl.get(), 0, 0), w);
  return owned(H5Gcreate2(parent, name, H5P_DEFAULT, gcpl.get(), H5P_DEFAULT), H5Gclose, w);
}

std::vector<std::string> link_names(hid_t group, const Where& w) {
  std::vector<std::string> names;
  check(H5Literate(
            group, H5_INDEX_NAME, H5_ITER_INC, nullptr,
            [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
              static_cast<std::vector<std::string>*>(data)->push_back(name);
              return 0;
            },
            &names),
        w, Errc::not_a_checkpoint);
  return names;
}

bool link_exists(hid_t parent, const char* name, const Where& w) {
  return check(H5Lexists(parent, name, H5P_DEFAULT), w, Errc::not_a_checkpoint) > 0;
}

bool hard_link_exists(hid_t parent, const char* name, const Where& w) {
  if (!link_exists(parent, name, w)) return false;
  H5L_info_t info;
  check(H5Lget_info(parent, name, &info, H5P_DEFAULT), w, Errc::not_a_checkpoint);
  return info.type == H5L_TYPE_HARD;
}

std::string printable(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    constexpr char hex[] = "0123456789abcdef";
    if (u >= 0x20 && u < 0x7f)
      out += c;
    else
      out += {'\\', 'x', hex[u >> 4], hex[u & 15]};
  }
  return out;
}

std::optional<std::string> link_kind(hid_t parent, const char* name, const Where& w) {
  H5L_info_t info;
  check(H5Lget_info(parent, name, &info, H5P_DEFAULT), w, Errc::not_a_checkpoint);
  if (info.type == H5L_TYPE_HARD) return std::nullopt;
  constexpr std::size_t max_value = std::size_t{1} << 16;  // a link's value is the file's to say
  const auto value = [&]() -> std::optional<std::vector<char>> {
    if (info.u.val_size == 0 || info.u.val_size > max_value) return std::nullopt;
    std::vector<char> v(info.u.val_size + 1, '\0');
    if (H5Lget_val(parent, name, v.data(), v.size(), H5P_DEFAULT) < 0) {
      H5Eclear2(H5E_DEFAULT);
      return std::nullopt;
    }
    return v;
  };
  if (info.type == H5L_TYPE_SOFT) {
    const auto v = value();
    return cat("a soft link", v ? cat(" to '", printable(v->data()), "'") : "");
  }
  if (info.type == H5L_TYPE_EXTERNAL) {
    const auto v = value();
    unsigned flags = 0;
    const char *target_file = nullptr, *target = nullptr;
    const bool unpacked = v && H5Lunpack_elink_val(v->data(), v->size() - 1, &flags, &target_file, &target) >= 0 &&
                          target_file && target;
    H5Eclear2(H5E_DEFAULT);
    return cat("an external link",
               unpacked ? cat(" to '", printable(target), "' in the file '", printable(target_file), "'") : "");
  }
  return cat("a user-defined link (HDF5 link type ", static_cast<int>(info.type), ")");
}

H5O_type_t object_type(hid_t parent, const char* name, const Where& w) {
  H5O_info_t info;
  check(H5Oget_info_by_name2(parent, name, &info, H5O_INFO_BASIC, H5P_DEFAULT), w, Errc::not_a_checkpoint);
  return info.type;
}

// ---- attributes ---------------------------------------------------------------------------------------

namespace {

void write_raw_attr(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, const void* data,
                    std::span<const hsize_t> dims, const Where& w) {
  Hid space = owned(dims.empty() ? H5Screate(H5S_SCALAR)
                                 : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                    H5Sclose, w);
  Hid attr = owned(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, w);
  check(H5Awrite(attr.get(), mem_type, data), w);
  attr.close(w);
}

// An open attribute with its type and extent, checked before anything is read from it.
struct OpenAttr {
  Hid attr, type;
  H5T_class_t cls = H5T_NO_CLASS;
  std::size_t size = 0;
  int rank = 0;
  std::vector<hsize_t> dims;
  hsize_t elements = 0;
};

[[noreturn]] void refuse(const Where& w, const char* name, Errc code, std::string_view why) {
  H5Eclear2(H5E_DEFAULT);
  throw Error(code, cat(w.file.string(), ": attribute ", name, w.key.empty() ? "" : " of ", w.key, " ", why));
}

OpenAttr open_attr(hid_t obj, const char* name, const Where& w, Errc code) {
  OpenAttr a;
  a.attr = owned(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose, w, code);
  a.type = owned(H5Aget_type(a.attr.get()), H5Tclose, w, code);
  a.cls = H5Tget_class(a.type.get());
  a.size = H5Tget_size(a.type.get());
  Hid space = owned(H5Aget_space(a.attr.get()), H5Sclose, w, code);
  const H5S_class_t scls = H5Sget_simple_extent_type(space.get());
  if (scls == H5S_NULL) refuse(w, name, code, "has no value (null dataspace)");
  a.rank = check(H5Sget_simple_extent_ndims(space.get()), w, code);
  if (a.rank > 32) refuse(w, name, code, cat("has rank ", a.rank));
  a.dims.resize(static_cast<std::size_t>(a.rank));
  check(H5Sget_simple_extent_dims(space.get(), a.dims.data(), nullptr), w, code);
  a.elements = 1;
  for (hsize_t d : a.dims) {
    if (d != 0 && a.elements > std::numeric_limits<std::uint32_t>::max() / d)
      refuse(w, name, code, "has too many elements");
    a.elements *= d;
  }
  return a;
}

void require_single(const OpenAttr& a, const Where& w, const char* name, Errc code, std::string_view what) {
  if (a.elements != 1 || a.rank > 1) refuse(w, name, code, cat("must be one ", what, " (it has shape of rank ", a.rank, " with ", a.elements, " elements)"));
}

std::int64_t int_of(const OpenAttr& a, const Where& w, const char* name, Errc code) {
  require_single(a, w, name, code, "integer");
  if (a.cls != H5T_INTEGER || a.size > 8) refuse(w, name, code, "is not an integer of at most 64 bits");
  if (H5Tget_sign(a.type.get()) == H5T_SGN_NONE && a.size == 8) {
    std::uint64_t v = 0;
    check(H5Aread(a.attr.get(), H5T_NATIVE_UINT64, &v), w, code);
    if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      refuse(w, name, code, cat("holds ", v, ", past the int64 range"));
    return static_cast<std::int64_t>(v);
  }
  std::int64_t v = 0;
  check(H5Aread(a.attr.get(), H5T_NATIVE_INT64, &v), w, code);
  return v;
}

std::string string_of(const OpenAttr& a, const Where& w, const char* name, Errc code) {
  require_single(a, w, name, code, "string");
  if (a.cls != H5T_STRING) refuse(w, name, code, "is not a string");
  if (H5Tis_variable_str(a.type.get()) > 0) {  // as h5py writes strings
    Hid mem = owned(H5Tcopy(H5T_C_S1), H5Tclose, w, code);
    check(H5Tset_size(mem.get(), H5T_VARIABLE), w, code);
    check(H5Tset_cset(mem.get(), H5Tget_cset(a.type.get())), w, code);
    char* text = nullptr;
    check(H5Aread(a.attr.get(), mem.get(), &text), w, code);
    std::string v = text ? text : "";
    H5free_memory(text);
    return v;
  }
  if (a.size == 0) refuse(w, name, code, "is a string of size 0");
  // Read into exactly the type's size, as the file's own type: no conversion, no overrun.
  std::string v(a.size, '\0');
  check(H5Aread(a.attr.get(), a.type.get(), v.data()), w, code);
  v.resize(std::strlen(v.c_str()));
  return v;
}

}  // namespace

void write_attr(hid_t obj, const char* name, std::int64_t v, const Where& w) {
  write_raw_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &v, {}, w);
}

void write_attr(hid_t obj, const char* name, double v, const Where& w) {
  write_raw_attr(obj, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v, {}, w);
}

void write_attr(hid_t obj, const char* name, std::string_view v, const Where& w) {
  Hid type = owned(H5Tcopy(H5T_C_S1), H5Tclose, w);
  const std::size_t n = std::max<std::size_t>(v.size(), 1);
  check(H5Tset_size(type.get(), n), w);
  check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), w);
  std::string padded(v);
  padded.resize(n, '\0');
  write_raw_attr(obj, name, type.get(), type.get(), padded.data(), {}, w);
}

void write_attr(hid_t obj, const char* name, const CommonValue& v, const Where& w) {
  std::visit(
      [&](const auto& x) {
        if constexpr (std::is_same_v<std::decay_t<decltype(x)>, std::string>)
          write_attr(obj, name, std::string_view(x), w);
        else
          write_attr(obj, name, x, w);
      },
      v);
}

void write_attr(hid_t obj, const char* name, std::span<const std::int64_t> values, std::size_t cols, const Where& w) {
  const std::vector<hsize_t> dims =
      cols == 0 ? std::vector<hsize_t>{values.size()} : std::vector<hsize_t>{values.size() / cols, cols};
  const std::int64_t none = 0;  // H5Awrite refuses a null buffer, which an empty span (a scalar's shape) may hold
  write_raw_attr(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, values.empty() ? &none : values.data(), dims, w);
}

bool has_attr(hid_t obj, const char* name, const Where& w) {
  return check(H5Aexists(obj, name), w, Errc::not_a_checkpoint) > 0;
}

std::int64_t read_int(hid_t obj, const char* name, const Where& w, Errc refusal) {
  return int_of(open_attr(obj, name, w, refusal), w, name, refusal);
}

std::string read_string(hid_t obj, const char* name, const Where& w, Errc refusal) {
  return string_of(open_attr(obj, name, w, refusal), w, name, refusal);
}

CommonValue read_value(hid_t obj, const char* name, const Where& w, Errc refusal) {
  const OpenAttr a = open_attr(obj, name, w, refusal);
  switch (a.cls) {
    case H5T_INTEGER:
      return int_of(a, w, name, refusal);
    case H5T_FLOAT: {
      require_single(a, w, name, refusal, "number");
      if (a.size > 8) refuse(w, name, refusal, "is a float wider than 64 bits");
      double v = 0;
      check(H5Aread(a.attr.get(), H5T_NATIVE_DOUBLE, &v), w, refusal);
      return v;
    }
    case H5T_STRING:
      return string_of(a, w, name, refusal);
    default:
      refuse(w, name, refusal, "has a type shardckpt does not read (integer, float or string)");
  }
}

std::vector<std::int64_t> read_ints(hid_t obj, const char* name, std::size_t cols, std::size_t max_values,
                                    const Where& w, Errc refusal) {
  const OpenAttr a = open_attr(obj, name, w, refusal);
  if (a.cls != H5T_INTEGER || a.size > 8) refuse(w, name, refusal, "is not an integer array");
  const int rank = cols == 0 ? 1 : 2;
  if (a.rank != rank || (cols != 0 && a.dims[1] != cols))
    refuse(w, name, refusal, cols == 0 ? "is not a 1-D array" : cat("is not a 2-D array of ", cols, " columns"));
  if (a.elements > max_values) refuse(w, name, refusal, cat("has ", a.elements, " values, more than ", max_values));
  std::vector<std::int64_t> v(static_cast<std::size_t>(a.elements));
  if (!v.empty()) check(H5Aread(a.attr.get(), H5T_NATIVE_INT64, v.data()), w, refusal);
  return v;
}

void for_each_attr(hid_t obj, const Where& w, const std::function<void(const char*)>& fn) {
  struct Visit {
    const std::function<void(const char*)>* fn;
    std::exception_ptr error;
  } visit{&fn, nullptr};
  const herr_t rc = H5Aiterate2(
      obj, H5_INDEX_NAME, H5_ITER_INC, nullptr,
      [](hid_t, const char* name, const H5A_info_t*, void* data) -> herr_t {
        auto& v = *static_cast<Visit*>(data);
        try {
          (*v.fn)(name);
          return 0;
        } catch (...) {  // exceptions must not unwind through HDF5's C frames
          v.error = std::current_exception();
          return -1;
        }
      },
      &visit);
  if (visit.error) {
    H5Eclear2(H5E_DEFAULT);
    std::rethrow_exception(visit.error);
  }
  check(rc, w, Errc::not_a_checkpoint);
}

// ---- datasets ---------------------------------------------------------------------------------------

bool null_dataspace(hid_t dataset, const Where& w, Errc refusal) {
  Hid space = owned(H5Dget_space(dataset), H5Sclose, w, refusal);
  return check(H5Sget_simple_extent_type(space.get()), w, refusal) == H5S_NULL;
}

std::vector<std::int64_t> shape_of(hid_t dataset, const Where& w, Errc refusal) {
  Hid space = owned(H5Dget_space(dataset), H5Sclose, w, refusal);
  // A null dataspace has rank 0 too, but no element: not a scalar.
  if (check(H5Sget_simple_extent_type(space.get()), w, refusal) == H5S_NULL)
    throw Error(refusal, cat(w.file.string(), ": dataset ", w.key, " has no value (a null dataspace)"));
  const int rank = check(H5Sget_simple_extent_ndims(space.get()), w, refusal);
  if (rank > 32) throw Error(refusal, cat(w.file.string(), ": dataset ", w.key, " has rank ", rank));
  std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
  check(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), w, refusal);
  std::vector<std::int64_t> out;
  for (hsize_t d : dims) {
    if (d > static_cast<hsize_t>(std::numeric_limits<std::int64_t>::max()))
      throw Error(refusal, cat(w.file.string(), ": dataset ", w.key, " has a dimension of ", d));
    out.push_back(static_cast<std::int64_t>(d));
  }
  (void)element_count(out, cat(w.file.string(), ": elements of dataset ", w.key), refusal);
  return out;
}

namespace {

// Hyperslab blocks (start, count over `dims`) that cover the flat row-major elements [a, b) of an
// array of shape `dims`: at most two partial blocks per dimension around one whole block.
void flat_blocks(std::int64_t a, std::int64_t b, std::span<const std::int64_t> dims, std::vector<hsize_t>& start,
                 std::vector<hsize_t>& count, std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>>& out) {
  if (a >= b) return;
  if (dims.size() == 1) {
    start.push_back(static_cast<hsize_t>(a));
    count.push_back(static_cast<hsize_t>(b - a));
    out.emplace_back(start, count);
    start.pop_back();
    count.pop_back();
    return;
  }
  const std::int64_t stride = element_count(dims.subspan(1));
  const auto inner = dims.subspan(1);
  const auto whole = [&](std::int64_t first, std::int64_t n) {
    start.push_back(static_cast<hsize_t>(first));
    count.push_back(static_cast<hsize_t>(n));
    std::vector<hsize_t> s = start, c = count;
    for (std::int64_t d : inner) {
      s.push_back(0);
      c.push_back(static_cast<hsize_t>(d));
    }
    out.emplace_back(std::move(s), std::move(c));
    start.pop_back();
    count.pop_back();
  };
  const auto part = [&](std::int64_t index, std::int64_t lo, std::int64_t hi) {
    start.push_back(static_cast<hsize_t>(index));
    count.push_back(1);
    flat_blocks(lo, hi, inner, start, count, out);
    start.pop_back();
    count.pop_back();
  };
  std::int64_t first = a / stride;
  const std::int64_t last = b / stride;
  if (first == last) return part(first, a % stride, b % stride);
  if (a % stride != 0) part(first++, a % stride, stride);
  if (last > first) whole(first, last - first);
  if (b % stride != 0) part(last, 0, b % stride);
}

struct Selection {
  Hid file_space, mem_space, type;
};

Selection select(hid_t dataset, DType dtype, std::span<const std::int64_t> shape, const Box& box,
                 std::int64_t mem_row_elems, std::int64_t mem_col, const Where& w) {
  Selection s{owned(H5Dget_space(dataset), H5Sclose, w), {}, type_of(dtype)};
  std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> blocks;
  std::vector<hsize_t> start{static_cast<hsize_t>(box.rows.begin)}, count{static_cast<hsize_t>(box.rows.size())};
  if (shape.empty())  // a scalar dataspace takes no hyperslab: its one element (the box is all of it)
    check(H5Sselect_all(s.file_space.get()), w);
  else if (shape.size() == 1)
    blocks.emplace_back(start, count);
  else
    flat_blocks(box.cols.begin, box.cols.end, shape.subspan(1), start, count, blocks);
  for (std::size_t i = 0; i < blocks.size(); ++i)
    check(H5Sselect_hyperslab(s.file_space.get(), i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR, blocks[i].first.data(),
                              nullptr, blocks[i].second.data(), nullptr),
          w);
  const hsize_t mem_dims[2] = {static_cast<hsize_t>(box.rows.size()),
                               static_cast<hsize_t>(std::max<std::int64_t>(mem_row_elems, 1))};
  s.mem_space = owned(H5Screate_simple(2, mem_dims, nullptr), H5Sclose, w);
  const hsize_t mem_start[2] = {0, static_cast<hsize_t>(mem_col)};
  const hsize_t mem_count[2] = {static_cast<hsize_t>(box.rows.size()), static_cast<hsize_t>(box.cols.size())};
  check(H5Sselect_hyperslab(s.mem_space.get(), H5S_SELECT_SET, mem_start, nullptr, mem_count, nullptr), w);
  return s;
}

// HDF5 reads and writes the bytes of a dataset with external storage in files it opens by name
// (resolved against HDF5_EXTFILE_PREFIX first: HDF5 1.10 reads the variable once, when it starts,
// and prefers it to the access property list's prefix, so neither a property nor a change of the
// environment overrides it), and those of a virtual dataset in the files
// of its sources. The library reads such bytes itself, through descriptors it opened (the reader's
// external files) or not at all (virtual datasets are refused): no transfer through HDF5 ever
// reaches one, whatever a caller asks.
void require_stored_in_file(hid_t dataset, const Where& w) {
  Hid dcpl = owned(H5Dget_create_plist(dataset), H5Pclose, w);
  const int externals = H5Pget_external_count(dcpl.get());
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (externals != 0 || layout == H5D_VIRTUAL || layout == H5D_LAYOUT_ERROR) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(Errc::not_a_checkpoint,
                cat(w.file.string(), ": dataset ", w.key, " keeps its bytes in other files (",
                    layout == H5D_VIRTUAL ? "a virtual dataset" : "external storage",
                    "), which HDF5 would open by name: they are never read or written through HDF5"));
  }
}

}  // namespace

void read_box(hid_t dataset, DType dtype, std::span<const std::int64_t> shape, const Box& box, void* mem,
              std::int64_t mem_row_elems, std::int64_t mem_col, const Where& w) {
  if (box.empty()) return;
  require_stored_in_file(dataset, w);
  const Selection s = select(dataset, dtype, shape, box, mem_row_elems, mem_col, w);
  check(H5Dread(dataset, s.type.get(), s.mem_space.get(), s.file_space.get(), H5P_DEFAULT, mem), w);
}

void write_box(hid_t dataset, DType dtype, std::span<const std::int64_t> shape, const Box& box, const void* mem,
               const Where& w) {
  if (box.empty()) return;
  require_stored_in_file(dataset, w);
  const Selection s = select(dataset, dtype, shape, box, box.cols.size(), 0, w);
  check(H5Dwrite(dataset, s.type.get(), s.mem_space.get(), s.file_space.get(), H5P_DEFAULT, mem), w);
}

}  // namespace shardckpt::hdf5
