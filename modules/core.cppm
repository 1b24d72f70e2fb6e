// shardckpt.core: the vocabulary every other module shares: the one error type of the library and
// the element types (dtypes) a checkpoint can hold. Nothing here allocates tensors or touches files.
module;
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
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
  not_a_checkpoint,           // the file is not a (complete) shardckpt checkpoint
  io,                         // the operating system refused a read or write
  hdf5,                       // the HDF5 library reported an error
  materialization_forbidden,  // a full copy was asked for inside ForbidMaterialization
  collective,                 // another rank failed, or the process group broke
  internal,                   // anything else (out of memory, say), carried across ranks as text
};

std::string_view errc_name(Errc code) noexcept;

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

// Builds a message from streamable parts: cat("key ", key, " rows [", lo, ", ", hi, ")").
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// Throws Error{code, message} unless `ok`. The one check for user input: never assert on it.
template <class... Parts>
void require(bool ok, Errc code, const Parts&... parts) {
  if (!ok) throw Error(code, cat(parts...));
}

// Elements of a shape (or of its trailing dims): the product of the dims, 1 for none.
constexpr std::int64_t element_count(std::span<const std::int64_t> dims) noexcept {
  std::int64_t n = 1;
  for (std::int64_t d : dims) n *= d;
  return n;
}

enum class DType : std::uint8_t { bf16, f16, f32, f64, i8, i16, i32, i64, u8, u16, u32, u64 };

inline constexpr DType all_dtypes[] = {DType::bf16, DType::f16, DType::f32, DType::f64, DType::i8,  DType::i16,
                                       DType::i32,  DType::i64, DType::u8,  DType::u16, DType::u32, DType::u64};

constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::i8:
    case DType::u8:
      return 1;
    case DType::bf16:
    case DType::f16:
    case DType::i16:
    case DType::u16:
      return 2;
    case DType::f32:
    case DType::i32:
    case DType::u32:
      return 4;
    case DType::f64:
    case DType::i64:
    case DType::u64:
      return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::i8:
      return "i8";
    case DType::i16:
      return "i16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
    case DType::u16:
      return "u16";
    case DType::u32:
      return "u32";
    case DType::u64:
      return "u64";
  }
  return "?";
}

// Parses a name printed by dtype_name; throws Errc::invalid_argument otherwise.
DType parse_dtype(std::string_view name);

}  // namespace shardckpt
