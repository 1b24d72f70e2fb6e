module;
#include <string_view>
module shardckpt.core;

namespace shardckpt {

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
    case Errc::io:
      return "io";
    case Errc::hdf5:
      return "hdf5";
    case Errc::materialization_forbidden:
      return "materialization_forbidden";
    case Errc::collective:
      return "collective";
    case Errc::internal:
      return "internal";
  }
  return "unknown";
}

DType parse_dtype(std::string_view name) {
  for (DType t : all_dtypes)
    if (dtype_name(t) == name) return t;
  throw Error(Errc::invalid_argument,
              cat("unknown dtype '", name, "' (expected bf16, f16, f32, f64, i8..i64, u8..u64)"));
}

}  // namespace shardckpt
