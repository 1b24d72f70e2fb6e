module;
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <variant>
module shardckpt.core;

namespace shardckpt {

#ifndef SHARDCKPT_VERSION
#error "the build defines SHARDCKPT_VERSION (meson.build's project version)"
#endif
std::string_view library_version() noexcept { return SHARDCKPT_VERSION; }

// clang 19 does not instantiate, in a file that imports shardckpt.core without including <map>, the
// hidden friend operator== of libstdc++'s map iterators (declared in this module's global module
// fragment): that file's `values.at(key)`, `find(key) != end()` or loop over a Values compiles and
// then misses the symbol at link time. Calls the optimizer may not inline make this library define
// both (weak, exported), so that such files link.
namespace detail {
[[clang::optnone]] bool values_iterators_equal(Values::iterator a, Values::iterator b) { return a == b; }
[[clang::optnone]] bool values_iterators_equal(Values::const_iterator a, Values::const_iterator b) { return a == b; }
}  // namespace detail

std::string_view errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::layout:
      return "layout";
    case Errc::tiling:
      return "tiling";
    case Errc::dtype_mismatch:
      return "dtype_mismatch";
    case Errc::shape_mismatch:
      return "shape_mismatch";
    case Errc::missing_key:
      return "missing_key";
    case Errc::not_a_checkpoint:
      return "not_a_checkpoint";
    case Errc::corrupt:
      return "corrupt";
    case Errc::replaced:
      return "replaced";
    case Errc::io:
      return "io";
    case Errc::hdf5:
      return "hdf5";
    case Errc::materialization_forbidden:
      return "materialization_forbidden";
    case Errc::device:
      return "device";
    case Errc::collective:
      return "collective";
    case Errc::resources:
      return "resources";
    case Errc::shard_changed:
      return "shard_changed";
    case Errc::committed_peer_failed:
      return "committed_peer_failed";
    case Errc::internal:
      return "internal";
  }
  return "unknown";
}

namespace {
// A name as a message shows it: a NUL as \0, and a long one cut to its first 64 bytes.
std::string shown(std::string_view name) {
  std::string out;
  for (char c : name.substr(0, 64)) out += c == '\0' ? std::string("\\0") : std::string(1, c);
  if (name.size() > 64) out += cat("... (", name.size(), " bytes)");
  return out;
}
}  // namespace

void require_name(std::string_view name, std::string_view what) {
  require(!name.empty(), Errc::invalid_argument, what, " must not be empty");
  require(name.size() <= max_name_bytes, Errc::invalid_argument, what, " '", shown(name), "' is longer than ",
          max_name_bytes, " bytes, the longest name shardckpt stores");
  const auto nul = name.find('\0');
  require(nul == std::string_view::npos, Errc::invalid_argument, what, " '", shown(name),
          "' has a NUL byte at byte ", nul, ": HDF5 would cut the name there");
}

void require_text(std::string_view key, std::string_view value) {
  const auto nul = value.find('\0');
  require(nul == std::string_view::npos, Errc::invalid_argument, "the value of '", shown(key), "' ('", shown(value),
          "') has a NUL byte at byte ", nul, ": HDF5 would cut the string there");
}

std::string dims_text(std::span<const std::int64_t> dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

DType parse_dtype(std::string_view name) {
  for (const DTypeInfo& t : dtype_table)
    if (t.name == name) return t.dtype;
  throw Error(Errc::invalid_argument,
              cat("unknown dtype '", name, "' (expected bf16, f16, f32, f64, i8..i64, u8..u64)"));
}

bf16 to_bf16(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  if (std::isnan(value)) return bf16::from_bits(static_cast<std::uint16_t>((bits >> 16) | 0x40));  // stay quiet NaN
  const std::uint32_t rounding = 0x7FFF + ((bits >> 16) & 1);                                   // nearest even
  return bf16::from_bits(static_cast<std::uint16_t>((bits + rounding) >> 16));
}

float to_f32(bf16 value) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits()) << 16); }

f16 to_f16(float value) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000;
  const std::uint32_t abs = bits & 0x7FFFFFFF;
  if (abs > 0x7F800000) return f16::from_bits(static_cast<std::uint16_t>(sign | 0x7E00));   // NaN
  if (abs >= 0x477FF000) return f16::from_bits(static_cast<std::uint16_t>(sign | 0x7C00));  // rounds past 65504: inf
  if (abs < 0x38800000) {  // below the smallest normal half: subnormal or zero
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24: units of 2^-24
    return f16::from_bits(static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(std::nearbyint(scaled))));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
  return f16::from_bits(static_cast<std::uint16_t>(sign | ((rounded - 0x38000000) >> 13)));
}

float to_f32(f16 value) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits() & 0x8000) << 16;
  const std::uint32_t exp = (value.bits() >> 10) & 0x1F;
  const std::uint32_t man = value.bits() & 0x3FF;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7F800000 | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

}  // namespace shardckpt
