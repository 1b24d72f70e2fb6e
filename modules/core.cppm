// shardckpt.core: the vocabulary every other module shares: the one error type of the library,
// checked arithmetic for sizes that come from files and command lines, and the element types
// (dtypes) a checkpoint can hold, described once in one table. Nothing here allocates tensors or
// touches files.
module;
#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
export module shardckpt.core;

export namespace shardckpt {

// What went wrong, for callers that branch; the message says it for people.
enum class Errc : std::uint8_t {
  invalid_argument,           // a bad value from the caller (sizes, names, flags)
  layout,                     // geometry that cannot be built (sections, TP, GTP, alignment)
  tiling,                     // pieces that overlap or leave a gap
  dtype_mismatch,             // ranks or file disagree on a dtype
  shape_mismatch,             // ranks or file disagree on a global shape
  missing_key,                // a key the request names is not in the checkpoint
  not_a_checkpoint,           // the file is not a (complete, well-formed) shardckpt checkpoint
  corrupt,                    // bytes read back differ from the bytes saved (a checksum mismatch)
  replaced,                   // the checkpoint at the path was replaced while it was being loaded
  io,                         // the operating system refused a read or write
  hdf5,                       // the HDF5 library reported an error
  materialization_forbidden,  // a full copy was asked for inside ForbidMaterialization
  collective,                 // another rank failed, or the process group broke
  device,                     // a device or its runtime failed, or there is none (CUDA)
  resources,                  // not enough memory, file descriptors or threads for what was asked
  shard_changed,              // a shard changed while a save read it (check_unchanged, or a row's hash
                              // before its write differs from the one after)
  internal,                   // anything else, carried across ranks as text
  committed_peer_failed,      // the save committed its checkpoint, then a peer failed (the file is complete)
};

std::string_view errc_name(Errc code) noexcept;

// The library's version, as its build (meson.build's project version) gives it: "0.3.0".
std::string_view library_version() noexcept;

// The library's only exception. Context is prepended on the way up ("while saving key K: ..."),
// so the message reads from the outermost operation to the root cause.
class Error : public std::exception {
 public:
  Error(Errc code, std::string message) : code_(code), message_(std::move(message)) {}
  Errc code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }
  std::string_view message() const noexcept { return message_; }
  Error& add_context(std::string_view context) {
    message_.insert(0, std::string(context) + ": ");
    return *this;
  }

 private:
  Errc code_;
  std::string message_;
};

// A value saved once for a whole checkpoint (an iteration, a learning rate, a configuration), and
// values by key. A file that reads a value needs <variant> (std::get, std::holds_alternative); a
// Values' members (at, find, a loop) need nothing more (src/core.cpp says why).
using CommonValue = std::variant<std::int64_t, double, std::string>;
using Values = std::map<std::string, CommonValue, std::less<>>;

// Builds a message from streamable parts: cat("key ", key, " rows [", lo, ", ", hi, ")").
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// Throws Error{code, message} unless `ok`. The one check for user input: never assert on it.
// The message is only built when the check fails.
template <class... Parts>
void require(bool ok, Errc code, const Parts&... parts) {
  if (!ok) [[unlikely]]
    throw Error(code, cat(parts...));
}

// The longest name (a key, a section, an optimizer state's name) the library stores: HDF5 refuses
// attribute names near 64 KiB, and no model needs a name this long.
inline constexpr std::size_t max_name_bytes = 4096;

// Refuses a name the file could not hold exactly: empty, longer than max_name_bytes, or with a NUL
// byte (HDF5 ends a name at its first NUL, so 't\0u' would come back as 't'). `what` says what the
// name names ("a state dict key").
void require_name(std::string_view name, std::string_view what);
// Refuses a string value the file could not hold exactly: one with a NUL byte.
void require_text(std::string_view key, std::string_view value);

// A shape in messages: [6, 4].
std::string dims_text(std::span<const std::int64_t> dims);

// ---- checked arithmetic -------------------------------------------------------------------------
// Every size, offset and element count computed from a file or a command line goes through these:
// an overflow is an Error{code} naming what was being computed, never a wrapped value.

inline std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what,
                                Errc code = Errc::invalid_argument) {
  std::int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]]
    throw Error(code, cat(what, ": ", a, " + ", b, " overflows 64-bit arithmetic"));
  return r;
}

inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what,
                                Errc code = Errc::invalid_argument) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]]
    throw Error(code, cat(what, ": ", a, " x ", b, " overflows 64-bit arithmetic"));
  return r;
}

// Elements of a shape (or of its trailing dims): the product of the dims, 1 for none. Negative
// dims and overflow are errors.
inline std::int64_t element_count(std::span<const std::int64_t> dims, std::string_view what = "element count",
                                  Errc code = Errc::invalid_argument) {
  std::int64_t n = 1;
  for (std::int64_t d : dims) {
    if (d < 0) [[unlikely]]
      throw Error(code, cat(what, ": dimension ", d, " is negative"));
    n = checked_mul(n, d, what, code);
  }
  return n;
}

// ---- 16-bit floats --------------------------------------------------------------------------------
// Storage types only: built from a float by a named, rounding conversion (to_bf16, to_f16) and read
// back with to_f32. No implicit or parenthesized construction from a number: `bf16(3.0f)` does not
// compile (it would otherwise store the bits 3).

class bf16 {
 public:
  constexpr bf16() noexcept = default;
  template <class T>
  bf16(T) = delete;
  static constexpr bf16 from_bits(std::uint16_t bits) noexcept {
    bf16 v;
    v.bits_ = bits;
    return v;
  }
  constexpr std::uint16_t bits() const noexcept { return bits_; }
  friend constexpr bool operator==(bf16, bf16) = default;

 private:
  std::uint16_t bits_ = 0;
};

class f16 {
 public:
  constexpr f16() noexcept = default;
  template <class T>
  f16(T) = delete;
  static constexpr f16 from_bits(std::uint16_t bits) noexcept {
    f16 v;
    v.bits_ = bits;
    return v;
  }
  constexpr std::uint16_t bits() const noexcept { return bits_; }
  friend constexpr bool operator==(f16, f16) = default;

 private:
  std::uint16_t bits_ = 0;
};

// Round to nearest even; NaN stays a NaN; f16 overflows to infinity and keeps subnormals.
bf16 to_bf16(float value) noexcept;
f16 to_f16(float value) noexcept;
float to_f32(bf16 value) noexcept;
float to_f32(f16 value) noexcept;

// ---- dtypes: one table ----------------------------------------------------------------------------

enum class DType : std::uint8_t { bf16, f16, f32, f64, i8, i16, i32, i64, u8, u16, u32, u64 };

enum class NumberKind : std::uint8_t { floating, signed_integer, unsigned_integer };

// Everything the library knows about a dtype; the HDF5 type (shardckpt.storage:hdf5), the C++ type
// (dtype_v below) and the parsers are derived from this table. Floats are little-endian IEEE-style
// with a sign bit on top, then `exponent_bits`, then `mantissa_bits`.
struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t size;
  NumberKind kind;
  int exponent_bits = 0;
  int mantissa_bits = 0;
  int exponent_bias = 0;
};

inline constexpr DTypeInfo dtype_table[] = {
    {DType::bf16, "bf16", 2, NumberKind::floating, 8, 7, 127},
    {DType::f16, "f16", 2, NumberKind::floating, 5, 10, 15},
    {DType::f32, "f32", 4, NumberKind::floating, 8, 23, 127},
    {DType::f64, "f64", 8, NumberKind::floating, 11, 52, 1023},
    {DType::i8, "i8", 1, NumberKind::signed_integer},
    {DType::i16, "i16", 2, NumberKind::signed_integer},
    {DType::i32, "i32", 4, NumberKind::signed_integer},
    {DType::i64, "i64", 8, NumberKind::signed_integer},
    {DType::u8, "u8", 1, NumberKind::unsigned_integer},
    {DType::u16, "u16", 2, NumberKind::unsigned_integer},
    {DType::u32, "u32", 4, NumberKind::unsigned_integer},
    {DType::u64, "u64", 8, NumberKind::unsigned_integer},
};

// The C++ element type of each dtype, in the table's order.
template <class... T>
struct TypeList {};
using DTypeCppTypes = TypeList<bf16, f16, float, double, std::int8_t, std::int16_t, std::int32_t, std::int64_t,
                               std::uint8_t, std::uint16_t, std::uint32_t, std::uint64_t>;

constexpr const DTypeInfo& dtype_info(DType t) noexcept { return dtype_table[static_cast<std::size_t>(t)]; }
constexpr std::size_t dtype_size(DType t) noexcept { return dtype_info(t).size; }
// The same as a signed count, for arithmetic with element counts and offsets.
constexpr std::int64_t element_bytes(DType t) noexcept { return static_cast<std::int64_t>(dtype_info(t).size); }
constexpr std::string_view dtype_name(DType t) noexcept { return dtype_info(t).name; }

// Parses a name printed by dtype_name; throws Errc::invalid_argument otherwise.
DType parse_dtype(std::string_view name);

namespace detail {
template <class T, class... Ts>
constexpr int index_of(TypeList<Ts...>) noexcept {
  constexpr bool same[] = {std::is_same_v<T, Ts>...};
  for (int i = 0; i < static_cast<int>(sizeof...(Ts)); ++i)
    if (same[i]) return i;
  return -1;
}
}  // namespace detail

template <class T>
concept Element = detail::index_of<std::remove_const_t<T>>(DTypeCppTypes{}) >= 0;
template <Element T>
inline constexpr DType dtype_v = static_cast<DType>(detail::index_of<std::remove_const_t<T>>(DTypeCppTypes{}));

}  // namespace shardckpt

namespace shardckpt {
// The table is indexed by the enum and agrees with the C++ types' sizes.
consteval bool dtype_table_is_consistent() {
  for (std::size_t i = 0; i < std::size(dtype_table); ++i)
    if (static_cast<std::size_t>(dtype_table[i].dtype) != i) return false;
  return sizeof(bf16) == 2 && sizeof(f16) == 2 && dtype_size(dtype_v<float>) == sizeof(float) &&
         dtype_size(dtype_v<double>) == 8 && dtype_v<std::uint64_t> == DType::u64;
}
static_assert(dtype_table_is_consistent());
}  // namespace shardckpt
