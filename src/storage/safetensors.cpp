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
import shardckpt.layout;
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

// A number of the header that is not a non-negative integer (a negative one, -0, one with a fraction
// or an exponent, one past 2^64 - 1) is kept in the parsed header as a binary value holding the
// number's text as the file wrote it: JSON text never parses to a binary value, so the reader can
// tell it apart, and its messages show what the file says ("-0", "1e2"), not what a double makes of
// it.
json number_text(std::string text) { return json::binary(std::vector<std::uint8_t>(text.begin(), text.end())); }

// A value of the header as the file wrote it, for messages (numbers kept as text shown as that text).
std::string shown(const json& v) {
  if (v.is_binary()) return std::string(v.get_binary().begin(), v.get_binary().end());
  if (v.is_array()) {
    std::string out = "[";
    for (const json& x : v) out += cat(out.size() > 1 ? ", " : "", shown(x));
    return out + "]";
  }
  if (v.is_object()) {
    std::string out = "{";
    for (const auto& [key, x] : v.items()) out += cat(out.size() > 1 ? ", " : "", quoted(key), ": ", shown(x));
    return out + "}";
  }
  return v.dump();
}

// The first number of a JSON text written with a leading zero ("01", "-007"), which JSON does not
// allow and the parser reports as a number where none may follow: for a clearer message.
std::optional<std::string> leading_zero(const std::string& text) {
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      continue;
    }
    const std::size_t at = c == '-' ? i + 1 : i;
    if (at + 1 >= text.size() || text[at] != '0' || !digit(text[at + 1]) || (i > 0 && (digit(text[i - 1]) || text[i - 1] == '.')))
      continue;
    std::size_t end = at + 1;
    while (end < text.size() && digit(text[end])) ++end;
    return text.substr(i, end - i);
  }
  return std::nullopt;
}

// Builds the header's value from the parser's events, in time linear in its size (nlohmann's
// callback parser scans the whole enclosing object at the end of every object: quadratic in the
// tensors), refusing on the way what strict JSON for a header does not allow: a key twice in one
// object, anything nested deeper than a tensor's entry.
class HeaderBuilder {
 public:
  explicit HeaderBuilder(const std::string& text) : text_(text) {}
  json root;

  bool null() { return value(json(nullptr)); }
  bool boolean(bool v) { return value(json(v)); }
  // The parser gives a negative integer here, its text exactly (JSON numbers have no leading zeros
  // or '+'); 0 here was written -0.
  bool number_integer(json::number_integer_t v) { return value(number_text(v == 0 ? "-0" : std::to_string(v))); }
  bool number_unsigned(json::number_unsigned_t v) { return value(json(v)); }
  bool number_float(json::number_float_t, const std::string& text) { return value(number_text(text)); }
  bool string(std::string& v) { return value(json(std::move(v))); }
  bool binary(json::binary_t&) { refuse("its header holds a binary value"); }
  bool start_object(std::size_t) { return open(json::object()); }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    json& object = *stack_.back();
    if (object.contains(k)) refuse(cat("the key ", quoted(k), " appears twice in one object of the header"));
    slot_ = &object[k];
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    if (const std::optional<std::string> n = leading_zero(text_)) {
      const std::size_t first = n->find_first_not_of("-0");
      refuse(cat("its header is not valid JSON: the number ", *n, " has a leading zero, which JSON does not allow (",
                 first == std::string::npos ? std::string("0") : cat(n->starts_with("-") ? "-" : "", n->substr(first)), " is written without one)"));
    }
    refuse(cat("its header is not valid JSON: ", printable(e.what())));
  }

 private:
  const std::string& text_;
  std::vector<json*> stack_;  // the open objects and arrays, outermost first
  json* slot_ = nullptr;      // where the next value of the innermost object goes

  json* place(json v) {
    if (stack_.empty()) return &(root = std::move(v));
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }
  bool value(json v) {
    (void)place(std::move(v));
    return true;
  }
  // Nesting: the root object (0), a tensor's entry (1), its shape (2), a dimension (3).
  bool open(json v) {
    if (stack_.size() >= static_cast<std::size_t>(max_depth))
      refuse(cat("the header nests deeper than a tensor's entry (", max_depth, " levels)"));
    stack_.push_back(place(std::move(v)));
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }
};

json parse_header(const std::string& text) {
  HeaderBuilder b(text);
  try {
    json::sax_parse(text, &b);
  } catch (const json::exception& e) {
    refuse(cat("its header is not valid JSON: ", printable(e.what())));
  }
  return std::move(b.root);
}

// Why a value of the header is not an integer from 0 to 2^63 - 1, in words.
std::string not_an_index(const json& v) {
  if (v.is_number_unsigned()) return "past 2^63 - 1";
  if (!v.is_binary()) return "not a number";
  const std::string text = shown(v);
  if (text == "-0") return "a negative zero (the safetensors package refuses it too: write 0)";
  if (text.find_first_of(".eE") != std::string::npos)
    return "written with a fraction or an exponent (an integer is written with digits only)";
  if (text.starts_with("-")) return "negative";
  return "past 2^64 - 1";
}

std::int64_t integer(const json& v, std::string_view what) {
  if (v.is_number_unsigned() && v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return v.get<std::int64_t>();
  refuse(cat(what, " is ", shown(v), ", ", not_an_index(v), ": not an integer from 0 to 2^63 - 1"));
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
    refuse(cat(t, " has dtype ", shown(dt), ", which shardckpt does not store (BF16, F16, F32, F64, I8 to I64, U8 to U64)"));
  std::vector<std::int64_t> shape = integers(v["shape"], cat(t, ": a dimension of its shape"));
  const std::vector<std::int64_t> offsets = integers(v["data_offsets"], cat(t, ": an offset of its data_offsets"));
  if (shape.size() > static_cast<std::size_t>(max_rank))
    refuse(cat(t, " has ", shape.size(), " dimensions; shardckpt adopts tensors of 0 (a scalar) to ", max_rank));
  if (offsets.size() != 2 || offsets[0] > offsets[1])
    refuse(cat(t, ": data_offsets ", shown(v["data_offsets"]), " is not [begin, end] with begin <= end"));
  const auto begin = static_cast<std::uint64_t>(offsets[0]), end = static_cast<std::uint64_t>(offsets[1]);
  if (end > data_bytes) refuse(cat(t, ": data_offsets [", begin, ", ", end, "] reach past the data, which has ", data_bytes, " bytes"));
  std::int64_t rows = 0, row = 0, bytes = 0;
  try {
    const Box whole = whole_box(shape);  // a scalar (shape []): one row of one element
    rows = whole.rows.size();
    row = checked_mul(whole.cols.size(), element_bytes(*dtype), "the bytes of a row");
    bytes = checked_mul(rows, row, "its bytes");
  } catch (const Error& e) {
    refuse(cat(t, " of shape ", dims_text(shape), ": ", e.what()));
  }
  if (static_cast<std::uint64_t>(bytes) != end - begin)
    refuse(cat(t, " of shape ", dims_text(shape), " and dtype ", dt.get<std::string>(), " has ", bytes,
               " bytes, but its data_offsets [", begin, ", ", end, "] hold ", end - begin));
  if (row == 0 && rows > 0) refuse(cat(t, " of shape ", dims_text(shape), " has rows without elements"));
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
