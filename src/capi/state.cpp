// The C API's state dicts, parameters, geometry and common values: C descriptions turned into the
// C++ library's ShardedParam and CommonValue, and Values handed back.
#include <cstddef>
#include <cstdint>
#include <map>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <cstring>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
#include "handles.hpp"

namespace shardckpt::capi {
namespace {

// A C enum's value as an int, read as its bytes: C may hold any int in it, which C++ may not load as
// the enum (its range is its enumerators').
template <class Enum>
int raw_of(const Enum& e) {
  std::underlying_type_t<Enum> raw;
  static_assert(sizeof raw == sizeof e);
  std::memcpy(&raw, &e, sizeof raw);
  return static_cast<int>(raw);
}

DType dtype_of(int i) {
  require(i >= 0 && i < static_cast<int>(std::size(dtype_table)), Errc::invalid_argument, "dtype ", i,
          " is not a shardckpt_dtype");
  return static_cast<DType>(i);
}

TpAxis tp_axis_of(int axis) {
  switch (axis) {
    case SHARDCKPT_TP_ROWS:
      return TpAxis::rows;
    case SHARDCKPT_TP_COLS:
      return TpAxis::cols;
    case SHARDCKPT_TP_REPLICATED:
      return TpAxis::replicated;
  }
  throw Error(Errc::invalid_argument, cat("tp_axis ", axis, " is not a shardckpt_tp_axis"));
}

// The parameter a C description names, without its shard, unchecked (check_param checks it, once).
ShardedParam param_of(const shardckpt_param& c) {
  require(c.key != nullptr, Errc::invalid_argument, "a parameter's key is NULL");
  require(c.sections != nullptr || c.section_count == 0, Errc::invalid_argument, "parameter ", c.key,
          ": sections is NULL");
  require(c.trailing != nullptr || c.trailing_count == 0, Errc::invalid_argument, "parameter ", c.key,
          ": trailing is NULL");
  require(c.divisors != nullptr || c.divisor_count == 0, Errc::invalid_argument, "parameter ", c.key,
          ": divisors is NULL");
  ShardedParam p{.spec = {.key = c.key, .sections = {}, .trailing = {}, .tp_axis = tp_axis_of(raw_of(c.tp_axis)), .tp = c.tp,
                          .divisors = {}},
                 .gtp = c.gtp,
                 .align = c.align,
                 .coord = {.tp_rank = c.tp_rank, .gtp_rank = c.gtp_rank},
                 .dtype = dtype_of(raw_of(c.dtype))};
  for (const shardckpt_section& s : std::span(c.sections, c.section_count))
    p.spec.sections.push_back({.name = s.name ? s.name : "", .rows = s.rows});
  p.spec.trailing.assign(c.trailing, c.trailing + c.trailing_count);
  for (const shardckpt_divisor& d : std::span(c.divisors, c.divisor_count))
    p.spec.divisors.push_back({.name = d.name ? d.name : "", .count = d.count});
  return p;
}

// The caller's buffer as the padded shard: a borrow, checked only by its size, which is all C says.
TensorRef shard_of(const ShardedParam& p, void* shard, std::size_t bytes) {
  const Extents shape = p.shard_shape();
  const auto need = static_cast<std::size_t>(shape.elements()) * dtype_size(p.dtype);
  require(bytes == need, Errc::shape_mismatch, p.describe(), ": the shard buffer holds ", bytes, " bytes; its padded ",
          "shard ", dtype_name(p.dtype), " ", dims_text(shape.dims()), " needs ", need, " bytes");
  return unchecked_borrow(MutTensorView::unchecked(shard, p.dtype, shape));
}

int add_value(shardckpt_state* state, const char* key, CommonValue value, const char* function) {
  if (state == nullptr) return null_argument(function, "state");
  if (key == nullptr) return null_argument(function, "key");
  return guarded([&] { state->dict.add_common(key, std::move(value)); });
}

// The kinds of the header are the alternatives of CommonValue, in order.
static_assert(std::is_same_v<std::variant_alternative_t<SHARDCKPT_VALUE_INT, CommonValue>, std::int64_t>);
static_assert(std::is_same_v<std::variant_alternative_t<SHARDCKPT_VALUE_DOUBLE, CommonValue>, double>);
static_assert(std::is_same_v<std::variant_alternative_t<SHARDCKPT_VALUE_STRING, CommonValue>, std::string>);
constexpr const char* kind_names[] = {"an int", "a double", "a string"};

// The value at `key`, of kind `Kind`, handed to `out`; Errc::missing_key or dtype_mismatch otherwise.
template <std::size_t Kind, class Out>
int get_value(const shardckpt_values* values, const char* key, Out* out, const char* function) {
  if (values == nullptr) return null_argument(function, "values");
  if (key == nullptr) return null_argument(function, "key");
  if (out == nullptr) return null_argument(function, "out");
  return guarded([&] {
    const auto it = values->values.find(std::string_view(key));
    require(it != values->values.end(), Errc::missing_key, "no common value ", key, " in the checkpoint");
    const auto* v = std::get_if<Kind>(&it->second);
    require(v != nullptr, Errc::dtype_mismatch, "common value ", key, " is ", kind_names[it->second.index()], ", not ",
            kind_names[Kind]);
    if constexpr (Kind == SHARDCKPT_VALUE_STRING)
      *out = v->c_str();
    else
      *out = *v;
  });
}

}  // namespace

shardckpt_values* values_of(Values values) {
  auto* out = new shardckpt_values{.values = std::move(values), .keys = {}};
  for (const auto& [key, value] : out->values) out->keys.push_back(key);
  return out;
}

}  // namespace shardckpt::capi

using namespace shardckpt::capi;

extern "C" {

int shardckpt_shard_rows(const shardckpt_param* param, int64_t* padded_rows, int64_t* real_rows) {
  if (param == nullptr) return null_argument("shardckpt_shard_rows", "param");
  return guarded([&] {
    const shardckpt::CheckedParam checked = shardckpt::check_param(param_of(*param));  // plans it once
    if (padded_rows) *padded_rows = checked.param().geometry().shard_rows();
    if (real_rows) *real_rows = checked.real_rows();
  });
}

shardckpt_state* shardckpt_state_new(void) {
  shardckpt_state* state = nullptr;
  (void)guarded([&] { state = new shardckpt_state; });
  return state;
}

void shardckpt_state_free(shardckpt_state* state) { delete state; }

int shardckpt_state_add_param(shardckpt_state* state, const shardckpt_param* param) {
  if (state == nullptr) return null_argument("shardckpt_state_add_param", "state");
  if (param == nullptr) return null_argument("shardckpt_state_add_param", "param");
  return guarded([&] {
    // checked once, before its buffer is typed by the padded shard's shape
    shardckpt::CheckedParam checked = shardckpt::check_param(param_of(*param));
    shardckpt::TensorRef shard = shard_of(checked.param(), param->shard, param->shard_bytes);
    state->dict.add(std::move(checked).with_shard(std::move(shard)));
  });
}

int shardckpt_state_add_int(shardckpt_state* state, const char* key, int64_t value) {
  return add_value(state, key, std::int64_t{value}, "shardckpt_state_add_int");
}

int shardckpt_state_add_double(shardckpt_state* state, const char* key, double value) {
  return add_value(state, key, value, "shardckpt_state_add_double");
}

int shardckpt_state_add_string(shardckpt_state* state, const char* key, const char* value) {
  if (value == nullptr) return null_argument("shardckpt_state_add_string", "value");
  return add_value(state, key, std::string(value), "shardckpt_state_add_string");
}

void shardckpt_values_free(shardckpt_values* values) { delete values; }

size_t shardckpt_values_count(const shardckpt_values* values) { return values ? values->keys.size() : 0; }

const char* shardckpt_values_key(const shardckpt_values* values, size_t index) {
  return values && index < values->keys.size() ? values->keys[index].c_str() : nullptr;
}

int shardckpt_values_kind(const shardckpt_values* values, const char* key, shardckpt_value_kind* kind) {
  if (values == nullptr) return null_argument("shardckpt_values_kind", "values");
  if (key == nullptr) return null_argument("shardckpt_values_kind", "key");
  if (kind == nullptr) return null_argument("shardckpt_values_kind", "kind");
  return guarded([&] {
    const auto it = values->values.find(std::string_view(key));
    shardckpt::require(it != values->values.end(), shardckpt::Errc::missing_key, "no common value ", key,
                       " in the checkpoint");
    *kind = static_cast<shardckpt_value_kind>(it->second.index());
  });
}

int shardckpt_values_int(const shardckpt_values* values, const char* key, int64_t* out) {
  return get_value<SHARDCKPT_VALUE_INT>(values, key, out, "shardckpt_values_int");
}

int shardckpt_values_double(const shardckpt_values* values, const char* key, double* out) {
  return get_value<SHARDCKPT_VALUE_DOUBLE>(values, key, out, "shardckpt_values_double");
}

int shardckpt_values_string(const shardckpt_values* values, const char* key, const char** out) {
  return get_value<SHARDCKPT_VALUE_STRING>(values, key, out, "shardckpt_values_string");
}

}  // extern "C"
