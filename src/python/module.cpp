// shardckpt._core: the extension module under the Python package shardckpt (python/shardckpt).
// Its names are the C++ library's, in Python style; shardckpt.Error carries the library's message
// and its code. This file: the layout types and the state dict (values.cpp: errors and values;
// resolve.cpp: a state dict's memory taken again before each save and load).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <variant>
#include <vector>

import shardckpt;

#include "binding.hpp"

namespace shardckpt::python {

void bind_tensor(py::module_& m);

void require_constructed(py::handle object, const std::type_info& type) {
  const py::detail::type_info* info = py::detail::get_type_info(type);
  if (info == nullptr || !object || !PyObject_TypeCheck(object.ptr(), info->type)) return;  // not ours to refuse
  auto* instance = reinterpret_cast<py::detail::instance*>(object.ptr());
  const py::detail::value_and_holder v = instance->get_value_and_holder(info, false);
  // A wrapper made by __init__ or by a cast holds its object's address (a reference a cast returned
  // holds no holder); only __new__ leaves it null, until pybind11's base caster would fill it with
  // raw memory, which this caster never lets it reach.
  if (v && v.value_ptr() != nullptr) return;
  const std::string name = py::str(py::type::of(object).attr("__name__"));
  throw py::type_error(cat("this ", name, " was made by ", name, ".__new__ without __init__: it holds no ", name));
}

namespace {

// A parameter, the Python object its shard came from (handed back by .shard) and the dtype its
// maker declared (dtype=), which every shard it is given must have.
struct Param {
  ShardedParam param;
  py::object shard = py::none();
  std::optional<DType> declared;
};

struct TensorEntry {
  ShardedTensor tensor;
  py::object data = py::none();
};

}  // namespace
}  // namespace shardckpt::python

SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::Param)
SHARDCKPT_CONSTRUCTED_ONLY(shardckpt::python::TensorEntry)

namespace shardckpt::python {
namespace {

DType dtype_arg(py::handle dtype) {
  std::string name = py::str(dtype);
  if (name.starts_with("torch.")) name = name.substr(6);
  static const std::map<std::string, std::string, std::less<>> aliases = {
      {"bfloat16", "bf16"}, {"float16", "f16"}, {"half", "f16"},  {"float32", "f32"},  {"float", "f32"},
      {"float64", "f64"},   {"double", "f64"},  {"int8", "i8"},   {"int16", "i16"},    {"int32", "i32"},
      {"int64", "i64"},     {"uint8", "u8"},    {"uint16", "u16"}, {"uint32", "u32"}, {"uint64", "u64"}};
  if (auto it = aliases.find(name); it != aliases.end()) name = it->second;
  try {
    return parse_dtype(name);
  } catch (const Error&) {
    throw py::type_error(cat("dtype ", name, ": shardckpt stores bf16, f16, f32, f64 and integers of 8 to 64 bits"));
  }
}

// (rows, trailing...) of a TP rank's weight, and of the weight without TP (its record's blocks one
// after another, the record's global trailing dims).
std::vector<std::int64_t> local_shape_of(const ParamSpec& s) {
  std::vector<std::int64_t> out{s.rows()};
  out.insert(out.end(), s.trailing.begin(), s.trailing.end());
  return out;
}

std::vector<std::int64_t> global_shape_of(const ParamSpec& s) {
  const ParamRecord r = record_of(s);
  std::vector<std::int64_t> out{0};
  for (const Section& b : r.blocks) out[0] = checked_add(out[0], b.rows, cat(s.key, ": global rows"), Errc::layout);
  out.insert(out.end(), r.trailing.begin(), r.trailing.end());
  return out;
}

void set_shard(Param& p, py::object tensor) {
  if (tensor.is_none()) {
    p.param.shard = {};
    p.shard = py::none();
    return;
  }
  const ParamSpec& spec = p.param.spec;
  const std::string& key = spec.key;
  SharedBuffer buffer = buffer_from_dlpack(tensor, key);
  const Extents want = p.param.shard_shape();
  if (buffer.shape() != want) {
    // The likely slip of a row-parallel weight: trailing given as the global width.
    const bool cols = spec.tp_axis == TpAxis::cols && !p.param.flat && buffer.shape().rank() >= 2 &&
                      want.rank() >= 2 && buffer.shape().dims()[1] != want.dims()[1];
    throw py::value_error(cat(key, ": a shard of shape ", dims_text(buffer.shape().dims()), ", not the ",
                              p.param.flat ? "flat range's " : "padded shard's ", dims_text(want.dims()),
                              " (ShardedParam.padded_shape())",
                              cols ? cat("; for tp_axis=\"cols\" trailing[0] is this TP rank's columns, the global "
                                         "weight's dim 1 / tp (this spec's trailing ", dims_text(spec.trailing),
                                         " at TP ", spec.tp, " makes a global weight of shape ",
                                         dims_text(global_shape_of(spec)), ": ParamSpec.global_shape())")
                                   : std::string()));
  }
  if (p.declared && buffer.dtype() != *p.declared)
    throw py::type_error(cat(key, ": a shard of dtype ", dtype_name(buffer.dtype()), ", but the parameter is declared ",
                             dtype_name(*p.declared), " (dtype=): convert the tensor, or declare its dtype"));
  p.param.dtype = buffer.dtype();
  p.param.shard = TensorRef(std::move(buffer));
  p.shard = std::move(tensor);
}

py::tuple shape_tuple(const Extents& e) { return py::tuple(py::cast(e.to_vector())); }

constexpr const char* kParamSpecDoc =
    "One parameter as a TP rank holds it before GTP. Every size is this TP rank's: `sections` are its rows of "
    "each block, in row order (gdp_in_proj_sections(dims, tp) and its siblings; plain_sections(rows) for a plain "
    "weight), `trailing` the dims after dim 0 of its weight. For tp_axis=\"rows\" (column-parallel and fused "
    "weights) TP splits dim 0 block by block and `trailing` is the global one; for \"cols\" (a row-parallel "
    "weight such as out_proj, one section) TP splits dim 1: the sections hold all the rows and trailing[0] is this "
    "rank's columns, the global dim 1 / tp (a global weight of shape (256, 1024) at TP 4 is plain_sections(256), "
    "[256]); for \"replicated\" (a norm weight, every rank holds all of it) rows and trailing are the global ones. "
    "local_shape() and global_shape() say what they make; global_shape=(...) (keyword) checks it at construction. "
    "`divisors`: the global sizes TP must divide (ssm_divisors(dims) for a fused layout), recorded in the checkpoint "
    "so that a load at a TP they do not divide is refused.";

void bind_param_spec(py::module_& m);

void bind_specs(py::module_& m) {
  py::class_<SsmDims>(m, "SsmDims", "Global model sizes the fused layouts are computed from.")
      .def(py::init([](std::int64_t heads, std::int64_t head_dim, std::int64_t groups, std::int64_t state,
                       std::int64_t householder) { return SsmDims{heads, head_dim, groups, state, householder}; }),
           py::arg("heads"), py::arg("head_dim"), py::arg("groups"), py::arg("state"), py::arg("householder") = 1)
      .def_readwrite("heads", &SsmDims::heads)
      .def_readwrite("head_dim", &SsmDims::head_dim)
      .def_readwrite("groups", &SsmDims::groups)
      .def_readwrite("state", &SsmDims::state)
      .def_readwrite("householder", &SsmDims::householder);
  py::class_<Section>(m, "Section", "A named run of TP-local rows of a fused weight ('' for a plain one).")
      .def(py::init([](std::string name, std::int64_t rows) { return Section{std::move(name), rows}; }),
           py::arg("name"), py::arg("rows"))
      .def_readonly("name", &Section::name)
      .def_readonly("rows", &Section::rows)
      .def("__eq__", [](const Section& a, const Section& b) { return a == b; })
      .def("__repr__", [](const Section& s) { return cat("Section(", std::string(py::repr(py::str(s.name))), ", ", s.rows, ")"); });
  m.def("gdp_in_proj_sections", &gdp_in_proj_sections, py::arg("dims"), py::arg("tp"));
  m.def("gdp_conv1d_sections", &gdp_conv1d_sections, py::arg("dims"), py::arg("tp"));
  m.def("mamba_in_proj_sections", &mamba_in_proj_sections, py::arg("dims"), py::arg("tp"));
  m.def("mamba_conv1d_sections", &mamba_conv1d_sections, py::arg("dims"), py::arg("tp"));
  m.def("plain_sections", &plain_sections, py::arg("rows"));
  py::class_<TpDivisor>(m, "TpDivisor", "A global model size TP must divide (heads, groups).")
      .def(py::init([](std::string name, std::int64_t count) { return TpDivisor{std::move(name), count}; }),
           py::arg("name"), py::arg("count"))
      .def_readonly("name", &TpDivisor::name)
      .def_readonly("count", &TpDivisor::count)
      .def("__eq__", [](const TpDivisor& a, const TpDivisor& b) { return a == b; })
      .def("__repr__", [](const TpDivisor& d) { return cat("TpDivisor('", d.name, "', ", d.count, ")"); });
  m.def("ssm_divisors", &ssm_divisors, py::arg("dims"), "What a fused GDP or Mamba weight must be given: heads, groups.");
  bind_param_spec(m);
}

void bind_param_spec(py::module_& m) {
  py::class_<ParamSpec>(m, "ParamSpec", kParamSpecDoc)
      .def(py::init([](const py::str& key, std::vector<Section> sections, std::vector<std::int64_t> trailing,
                       const std::string& tp_axis, std::int64_t tp, std::vector<TpDivisor> divisors,
                       std::optional<std::vector<std::int64_t>> global_shape) {
             ParamSpec s{utf8_text(key, "key"), std::move(sections), std::move(trailing), parse_tp_axis(tp_axis), tp,
                         std::move(divisors)};
             validate(s);
             if (global_shape && *global_shape != global_shape_of(s))
               throw py::value_error(cat(s.key, ": sections and trailing ", dims_text(s.trailing), " at TP ", s.tp,
                                         " (tp_axis=\"", tp_axis_name(s.tp_axis), "\") make a global weight of shape ",
                                         dims_text(global_shape_of(s)), ", not the global_shape ",
                                         dims_text(*global_shape), ": sections and trailing are what one TP rank holds",
                                         s.tp_axis == TpAxis::cols ? " (for cols, trailing[0] is the global dim 1 / tp)"
                                                                   : ""));
             return s;
           }),
           py::arg("key"), py::arg("sections"), py::arg("trailing"), py::arg("tp_axis") = "rows", py::arg("tp") = 1,
           py::arg("divisors") = std::vector<TpDivisor>{}, py::kw_only(), py::arg("global_shape") = py::none())
      .def_readonly("key", &ParamSpec::key)
      .def_readonly("sections", &ParamSpec::sections)
      .def_readonly("trailing", &ParamSpec::trailing)
      .def_property_readonly("tp_axis", [](const ParamSpec& s) { return std::string(tp_axis_name(s.tp_axis)); })
      .def_readonly("tp", &ParamSpec::tp)
      .def_readonly("divisors", &ParamSpec::divisors)
      .def("rows", &ParamSpec::rows, "TP-local rows, all sections together.")
      .def("local_shape", [](const ParamSpec& s) { return py::tuple(py::cast(local_shape_of(s))); },
           "The weight as one TP rank holds it before GTP: (rows(), *trailing).")
      .def("global_shape", [](const ParamSpec& s) { return py::tuple(py::cast(global_shape_of(s))); },
           "The weight of a run without TP (TP=1): its blocks one after another at their global rows, and the "
           "global dims after dim 0. What shardckpt.read(path) gives back for this key.")
      .def("record",
           [](const ParamSpec& s) -> py::object {
             const py::list records = py::module_::import("json").attr("loads")(records_json({record_of(s)}));
             return records[0];
           },
           "The parameter's record, as a checkpoint holds it and shardckpt.adopt (and `shardckpt adopt "
           "--model-config`) takes it: a dict of key, tp_axis, blocks (name and global rows, in row order), the "
           "global trailing dims and the divisors.")
      .def("__repr__", [](const ParamSpec& s) {
        return cat("ParamSpec(", std::string(py::repr(value_text(s.key))), ", ", s.sections.size(),
                   " sections, trailing ", dims_text(s.trailing), ", tp_axis=\"", tp_axis_name(s.tp_axis), "\", tp=",
                   s.tp, "; local shape ", dims_text(local_shape_of(s)), ", global shape ",
                   dims_text(global_shape_of(s)), ")");
      });
}

constexpr const char* kSourceRowsDoc =
    "Where the real rows of this rank's padded shard come from, as the library's plan says: a list of "
    "(shard_begin, shard_end, row_begin, row_end, cols), one per run of rows, in shard row order: shard rows "
    "[shard_begin, shard_end) are rows [row_begin, row_end) of the weight without TP (TP=1: the blocks one after "
    "another at their global rows; with tp_local=True, of this TP rank's weight), and `cols` is the (begin, end) "
    "of its dim 1 they hold (this TP rank's columns of a tp_axis=\"cols\" weight), or None for all of it. Rows "
    "past the last run are pad rows. shard_of() cuts a shard by it.";

// The runs of source_rows: from the plan of this rank's pieces (plan_rank), each piece's rows of its
// block placed in the TP=1 weight, where block j starts after the global rows of the blocks before it.
py::list source_rows(const Param& p, bool tp_local) {
  const ShardedParam& param = p.param;
  const RankPlan plan = plan_rank(param.spec, param.gtp, param.align, param.coord);
  const std::vector<std::int64_t> local = local_shape_of(param.spec);
  // A TP rank holds all of dim 1 of its weight, and of the weight without TP unless TP splits it.
  const py::object all_cols = local.size() < 2 ? py::object(py::none()) : py::object(py::make_tuple(0, local[1]));
  py::list out;
  if (tp_local) {
    const Range real = plan.geometry.real_rows(param.coord.gtp_rank);
    if (!real.empty()) out.append(py::make_tuple(0, real.size(), real.begin, real.end, all_cols));
    return out;
  }
  std::vector<std::int64_t> starts{0};
  for (const Block& b : blocks(param.spec))
    starts.push_back(checked_add(starts.back(), b.global_shape[0], cat(param.spec.key, ": global rows"), Errc::layout));
  for (const Piece& piece : plan.pieces) {
    const std::int64_t row = starts[piece.block] + piece.global_offset[0];
    const py::object cols =
        param.spec.tp_axis == TpAxis::cols
            ? py::object(py::make_tuple(piece.global_offset[1], piece.global_offset[1] + piece.count[1]))
            : all_cols;
    out.append(py::make_tuple(piece.shard_row, piece.shard_row + piece.rows, row, row + piece.rows, cols));
  }
  return out;
}

constexpr const char* kPiecesDoc =
    "The pieces of this rank's padded shard, as the library saves and loads them (one plan): a list of dicts, "
    "one per run of the shard's rows inside one block, in shard row order: key (the block's dataset name, "
    "\"<key>.<section>\" for a fused weight), global_shape (the block's shape without GTP, as a plain TP run "
    "stores it), global_offset and count (the piece's box in it), shard_row and rows (the shard rows it is), "
    "main_replica (False for TP ranks other than 0 of a weight TP replicates). Pad rows are in none; a "
    "padding-only rank has none.";

// The pieces of pieces(): plan_rank's, as Python values.
py::list pieces_of(const Param& p) {
  const ShardedParam& param = p.param;
  const RankPlan plan = plan_rank(param.spec, param.gtp, param.align, param.coord);
  py::list out;
  for (const Piece& piece : plan.pieces) {
    py::dict d;
    d["key"] = value_text(piece.key);
    d["global_shape"] = py::tuple(py::cast(piece.global_shape));
    d["global_offset"] = py::tuple(py::cast(piece.global_offset));
    d["count"] = py::tuple(py::cast(piece.count));
    d["shard_row"] = piece.shard_row;
    d["rows"] = piece.rows;
    d["main_replica"] = plan.main_replica;
    out.append(std::move(d));
  }
  return out;
}

void bind_param(py::module_& m) {
  py::class_<Param>(m, "ShardedParam", "A GTP-sharded parameter as one rank holds it (its padded shard).")
      .def(py::init([](const ParamSpec& spec, std::int64_t gtp, std::int64_t align, std::int64_t tp_rank,
                       std::int64_t gtp_rank, py::object shard, int replica_id, int replicas, py::object dtype,
                       std::optional<std::pair<std::int64_t, std::int64_t>> flat) {
             Param p;
             p.param.spec = spec;
             p.param.gtp = gtp;
             p.param.align = align;
             p.param.coord = {tp_rank, gtp_rank};
             p.param.replica_id = replica_id;
             p.param.replicas = replicas;
             if (flat) p.param.flat = Range{flat->first, flat->second};
             if (!dtype.is_none()) p.param.dtype = *(p.declared = dtype_arg(dtype));
             (void)p.param.geometry();  // the geometry's errors now, not at the save
             set_shard(p, std::move(shard));
             return p;
           }),
           py::arg("spec"), py::arg("gtp"), py::arg("align"), py::arg("tp_rank"), py::arg("gtp_rank"),
           py::arg("shard") = py::none(), py::arg("replica_id") = 0, py::arg("replicas") = 1,
           py::arg("dtype") = py::none(), py::arg("flat") = py::none())
      .def_property_readonly("spec", [](const Param& p) { return p.param.spec; })
      .def_property_readonly("key", [](const Param& p) { return value_text(p.param.spec.key); })
      .def_property_readonly("dtype", [](const Param& p) { return std::string(dtype_name(p.param.dtype)); })
      .def_property_readonly("gtp", [](const Param& p) { return p.param.gtp; })
      .def_property_readonly("align", [](const Param& p) { return p.param.align; })
      .def_property_readonly("tp_rank", [](const Param& p) { return p.param.coord.tp_rank; })
      .def_property_readonly("gtp_rank", [](const Param& p) { return p.param.coord.gtp_rank; })
      .def_property("shard", [](const Param& p) { return p.shard; }, &set_shard)
      .def("padded_shape", [](const Param& p) { return shape_tuple(p.param.padded_shape()); })
      .def("shard_shape", [](const Param& p) { return shape_tuple(p.param.shard_shape()); })
      .def("real_rows", [](const Param& p) { return p.param.geometry().real_count(p.param.coord.gtp_rank); })
      .def_property_readonly("flat",
                             [](const Param& p) -> py::object {
                               if (!p.param.flat) return py::none();
                               return py::make_tuple(p.param.flat->begin, p.param.flat->end);
                             })
      .def_property_readonly("replica_id", [](const Param& p) { return p.param.replica_id; })
      .def_property_readonly("replicas", [](const Param& p) { return p.param.replicas; })
      .def("source_rows", &source_rows, py::arg("tp_local") = false, kSourceRowsDoc)
      .def("pieces", &pieces_of, kPiecesDoc)
      .def("optimizer_state",
           [](const Param& p, const std::string& name, py::object shard, py::object dtype) {
             Param s;
             if (!dtype.is_none()) s.declared = dtype_arg(dtype);
             s.param = optimizer_state(p.param, name, s.declared.value_or(DType::f32));
             set_shard(s, std::move(shard));
             return s;
           },
           py::arg("name"), py::arg("shard") = py::none(), py::arg("dtype") = py::none(),
           "The companion that holds optimizer state `name` (exp_avg, exp_avg_sq, ...), same layout.")
      .def("__repr__", [](const Param& p) { return p.param.describe(); });
}

void bind_tensor_entry(py::module_& m) {
  py::class_<TensorEntry>(m, "ShardedTensor", "A shard of a tensor under its global key, at its global offset.")
      .def(py::init([](const py::str& name, py::object data, std::vector<std::int64_t> global_shape,
                       std::vector<std::int64_t> global_offset, int replica_id, int replicas) {
             TensorEntry t;
             std::string key = utf8_text(name, "key");
             SharedBuffer buffer = buffer_from_dlpack(data, key);
             t.tensor = ShardedTensor::of(std::move(key), TensorRef(std::move(buffer)), std::move(global_shape),
                                          std::move(global_offset), replica_id, replicas);
             t.data = std::move(data);
             return t;
           }),
           py::arg("key"), py::arg("data"), py::arg("global_shape"), py::arg("global_offset"),
           py::arg("replica_id") = 0, py::arg("replicas") = 1)
      .def_static("expect",
                  [](const py::str& key, py::object dtype, std::vector<std::int64_t> shape,
                     std::vector<std::int64_t> global_shape, std::vector<std::int64_t> global_offset) {
                    TensorEntry t;
                    // shape [] (a scalar's, with global_shape []) is Extents{}, which expect makes [1].
                    const Extents extents = shape.empty() ? Extents() : Extents(std::span(shape));
                    t.tensor = ShardedTensor::expect(utf8_text(key, "key"), dtype_arg(dtype), extents,
                                                     std::move(global_shape), std::move(global_offset));
                    return t;
                  },
                  py::arg("key"), py::arg("dtype"), py::arg("shape"), py::arg("global_shape"),
                  py::arg("global_offset"), "A load request's entry: load() allocates it.")
      .def_property_readonly("key", [](const TensorEntry& t) { return value_text(t.tensor.key); })
      .def_property_readonly("data", [](const TensorEntry& t) { return t.data; });
}

// The object to take an entry's memory from again: a capsule is consumed once (its memory stays
// as it was taken), None has none.
py::object source_of(const py::object& object) {
  return PyCapsule_CheckExact(object.ptr()) ? py::object(py::none()) : object;
}

}  // namespace

void bind_state(py::module_& m) {
  bind_param(m);
  bind_tensor_entry(m);
  py::class_<PyStateDict>(m, "StateDict", "A rank's state: parameters, tensors, common and local values.")
      .def(py::init<>())
      .def("add",
           [](PyStateDict& s, const Param& p) {
             s.state.add(p.param);
             s.param_sources.push_back(source_of(p.shard));
           })
      .def("add",
           [](PyStateDict& s, const TensorEntry& t) {
             s.state.add(t.tensor);
             s.tensor_sources.push_back(source_of(t.data));
           })
      .def("add_common", [](PyStateDict& s, py::handle k, py::handle v) {
        std::string key = utf8_text(k, "key");
        CommonValue value = common_value(v, key);
        s.state.add_common(std::move(key), std::move(value));
      })
      .def("add_local", [](PyStateDict& s, py::handle k, py::handle v) {
        std::string key = utf8_text(k, "key");
        CommonValue value = common_value(v, key);
        s.state.add_local(std::move(key), std::move(value));
      })
      .def("keys", [](const PyStateDict& s) {
        py::list keys;
        for (const ShardedParam& p : s.state.params()) keys.append(value_text(p.spec.key));
        for (const ShardedTensor& t : s.state.tensors()) keys.append(value_text(t.key));
        for (const auto& [k, v] : s.state.common()) keys.append(value_text(k));
        for (const auto& [k, v] : s.state.local()) keys.append(value_text(k));
        return keys;
      })
      .def_property_readonly("common", [](const PyStateDict& s) { return python_values(s.state.common()); })
      .def("__len__", [](const PyStateDict& s) {
        return s.state.params().size() + s.state.tensors().size() + s.state.common().size() + s.state.local().size();
      });
}

void bind_layout(py::module_& m) { bind_specs(m); }

}  // namespace shardckpt::python

PYBIND11_MODULE(_core, m) {
  namespace sp = shardckpt::python;
  namespace py = pybind11;
  m.doc() = "shardckpt's C++ library, bound for Python (use the package shardckpt)";
  m.attr("__version__") = std::string(shardckpt::library_version());
  static py::exception<shardckpt::Error> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const shardckpt::Error& e) {
      const std::string text = sp::python_wording(std::string(e.message()));
      py::object exc = py::reinterpret_borrow<py::object>(error)(sp::message_text(text));
      exc.attr("code") = std::string(shardckpt::errc_name(e.code()));
      PyErr_SetObject(error.ptr(), exc.ptr());
    }
  });
  m.def("_python_wording", &sp::python_wording, "The words of a library message as a Python caller reads them.");
  sp::bind_tensor(m);
  sp::bind_layout(m);
  sp::bind_state(m);
  sp::bind_io(m);
}
