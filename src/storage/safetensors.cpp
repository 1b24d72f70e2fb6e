// The safetensors reader of adopt (src/storage/sources.cppm): the header of a file that Hugging
// Face's safetensors wrote, checked field by field before any of it is used.
module;
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.views;
import :file;
import :records;
import :sources;

namespace shardckpt {
namespace {

using json = nlohmann::json;

// The safetensors package refuses longer headers too; 100 MB describes millions of tensors.
constexpr std::uint64_t max_header_bytes = 100'000'000;
// A tensor's entry nests no deeper: root object, tensor object, shape array, a dim.
constexpr int max_depth = 3;
constexpr std::string_view metadata_key = "__metadata__";
constexpr char hdf5_signature[8] = {'\211', 'H', 'D', 'F', '\r', '\n', '\032', '\n'};

// Text from the file in a message: as a JSON string, control characters escaped.
std::string quoted(const std::string& text) { return json(text).dump(); }

// A message of the JSON parser, which quotes the file: bytes outside printable ASCII as \xHH.
std::string printable(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      constexpr char hex[] = "0123456789abcdef";
      out += {'\\', 'x', hex[u >> 4], hex[u & 15]};
    }
  }
  return out;
}

[[noreturn]] void refuse(std::string_view why) {
  throw Error(Errc::not_a_checkpoint, cat("not a safetensors file shardckpt can adopt: ", why));
}

// The dtype a safetensors name stands for: the library's own dtype names, upper case ("BF16" is
// bf16, "U8" is u8); others ("BOOL", "F8_E4M3", ...) have no dtype here.
std::optional<DType> dtype_named(std::string_view name) {
  for (const DTypeInfo& t : dtype_table) {
    std::string upper(t.name);
    for (char& c : upper)
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    if (upper == name) return t.dtype;
  }
  return std::nullopt;
}

// N, the header's length: at least "{}", inside the file, at most max_header_bytes.
std::uint64_t header_length(const io::File& f, std::uint64_t size) {
  if (size < 8) refuse(cat("it has ", size, " bytes, fewer than the 8 of the header length"));
  unsigned char b[8];
  f.pread_all(b, sizeof b, 0);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | b[i];
  if (n < 2) refuse(cat("the header length is ", n, " bytes, too short for a JSON object"));
  if (n > max_header_bytes) refuse(cat("the header length is ", n, " bytes, more than the limit of ", max_header_bytes));
  if (n > size - 8) refuse(cat("the header length is ", n, " bytes, but only ", size - 8, " follow it"));
  return n;
}

// Strict JSON: nothing nested deeper than a tensor's entry, no key twice in one object.
json parse_header(const std::string& text) {
  std::vector<std::set<std::string>> open;  // the keys of each object being parsed
  try {
    return json::parse(text, [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth > max_depth) refuse(cat("the header nests deeper than a tensor's entry (", max_depth, " levels)"));
      if (event == json::parse_event_t::object_start) open.emplace_back();
      if (event == json::parse_event_t::object_end) open.pop_back();
      if (event == json::parse_event_t::key && !open.back().insert(parsed.get<std::string>()).second)
        refuse(cat("the key ", quoted(parsed.get<std::string>()), " appears twice in one object of the header"));
      return true;
    });
  } catch (const json::exception& e) {
    refuse(cat("its header is not valid JSON: ", printable(e.what())));
  }
}

std::int64_t integer(const json& v, std::string_view what) {
  if (v.is_number_unsigned() && v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return v.get<std::int64_t>();
  refuse(cat(what, " is ", v.dump(), ", not an integer from 0 to 2^63 - 1"));
}

std::vector<std::int64_t> integers(const json& v, std::string_view what) {
  if (!v.is_array()) refuse(cat(what, " is not an array"));
  std::vector<std::int64_t> out;
  for (const json& x : v) out.push_back(integer(x, what));
  return out;
}

// Where a tensor's bytes lie in the data buffer, checked against its dtype and shape.
struct Entry {
  SourceTensor tensor;
  std::uint64_t begin = 0, end = 0;  // data_offsets, relative to the data buffer
};

Entry entry_of(const std::string& name, const json& v, std::uint64_t data_start, std::uint64_t data_bytes) {
  const std::string t = cat("tensor ", quoted(name));
  if (name.find('\0') != std::string::npos) refuse(cat(t, ": its name holds a NUL character"));
  try {
    require_key(name, "a dataset");
  } catch (const Error&) {
    refuse(cat(t, ": a dataset's name must be non-empty, contain no '/' and not start with '_'"));
  }
  if (!v.is_object()) refuse(cat(t, " is not an object"));
  for (const auto& [field, _] : v.items())
    if (field != "dtype" && field != "shape" && field != "data_offsets") refuse(cat(t, " has an unknown field \"", field, "\""));
  if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    refuse(cat(t, " lacks one of dtype, shape and data_offsets"));
  const json& dt = v["dtype"];
  const std::optional<DType> dtype = dt.is_string() ? dtype_named(dt.get<std::string>()) : std::nullopt;
  if (!dtype)
    refuse(cat(t, " has dtype ", dt.dump(), ", which shardckpt does not store (BF16, F16, F32, F64, I8 to I64, U8 to U64)"));
  std::vector<std::int64_t> shape = integers(v["shape"], cat(t, ": a dimension of its shape"));
  const std::vector<std::int64_t> offsets = integers(v["data_offsets"], cat(t, ": data_offsets"));
  if (shape.empty() || shape.size() > static_cast<std::size_t>(max_rank))
    refuse(cat(t, " has ", shape.size(), " dimensions; shardckpt adopts tensors of 1 to ", max_rank));
  if (offsets.size() != 2 || offsets[0] > offsets[1])
    refuse(cat(t, ": data_offsets ", v["data_offsets"].dump(), " is not [begin, end] with begin <= end"));
  const auto begin = static_cast<std::uint64_t>(offsets[0]), end = static_cast<std::uint64_t>(offsets[1]);
  if (end > data_bytes) refuse(cat(t, ": data_offsets [", begin, ", ", end, "] reach past the data, which has ", data_bytes, " bytes"));
  std::int64_t row = 0, bytes = 0;
  try {
    row = checked_mul(element_count(std::span(shape).subspan(1)), element_bytes(*dtype), "the bytes of a row");
    bytes = checked_mul(shape[0], row, "its bytes");
  } catch (const Error& e) {
    refuse(cat(t, " of shape ", dims_text(shape), ": ", e.what()));
  }
  if (static_cast<std::uint64_t>(bytes) != end - begin)
    refuse(cat(t, " of shape ", dims_text(shape), " and dtype ", dt.get<std::string>(), " has ", bytes,
               " bytes, but its data_offsets [", begin, ", ", end, "] hold ", end - begin));
  if (row == 0 && shape[0] > 0) refuse(cat(t, " of shape ", dims_text(shape), " has rows without elements"));
  return {{name, *dtype, std::move(shape), data_start + begin}, begin, end};
}

// No byte of the data belongs to two tensors.
void require_disjoint(std::vector<Entry>& entries) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  const Entry* last = nullptr;
  for (const Entry& e : entries) {
    if (e.begin == e.end) continue;
    if (last && last->end > e.begin)
      refuse(cat("tensors ", quoted(last->tensor.key), " (data_offsets [", last->begin, ", ", last->end, "]) and ",
                 quoted(e.tensor.key), " ([", e.begin, ", ", e.end, "]) share bytes"));
    last = &e;
  }
}

void check_metadata(const json& v) {
  if (!v.is_object()) refuse("__metadata__ is not an object");
  for (const auto& [key, value] : v.items())
    if (!value.is_string()) refuse(cat("__metadata__ ", quoted(key), " is not a string"));
}

}  // namespace

SourceFormat source_format(const io::File& f) {
  const std::uint64_t size = f.size();
  const auto signature_at = [&](std::uint64_t at) {
    char b[sizeof hdf5_signature] = {};
    return at + sizeof b <= size && (f.pread_all(b, sizeof b, at), std::equal(b, b + sizeof b, hdf5_signature));
  };
  if (signature_at(0)) return SourceFormat::hdf5;
  char brace = 0;
  if (size > 8 && (f.pread_all(&brace, 1, 8), brace == '{')) return SourceFormat::safetensors;
  for (std::uint64_t at = 512; at < size; at *= 2)
    if (signature_at(at)) return SourceFormat::hdf5;  // after a user block
  throw Error(Errc::not_a_checkpoint, "neither an HDF5 file (no HDF5 signature) nor a safetensors file (its byte 8 "
                                      "is not the '{' that opens a safetensors header)");
}

std::vector<SourceTensor> safetensors_tensors(const io::File& f) {
  const std::uint64_t size = f.size();
  const std::uint64_t n = header_length(f, size);
  std::string text(static_cast<std::size_t>(n), '\0');
  f.pread_all(text.data(), text.size(), 8);
  const json header = parse_header(text);
  if (!header.is_object()) refuse("its header is not a JSON object");
  std::vector<Entry> entries;
  for (const auto& [name, v] : header.items()) {
    if (name == metadata_key)
      check_metadata(v);
    else
      entries.push_back(entry_of(name, v, 8 + n, size - 8 - n));
  }
  require_disjoint(entries);
  std::vector<SourceTensor> out;
  for (Entry& e : entries) out.push_back(std::move(e.tensor));
  std::sort(out.begin(), out.end(), [](const SourceTensor& a, const SourceTensor& b) { return a.key < b.key; });
  if (out.empty()) refuse("it holds no tensor");
  return out;
}

}  // namespace shardckpt
