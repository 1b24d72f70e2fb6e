module;
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :records;

namespace shardckpt {

void require_key(std::string_view key, std::string_view what) {
  require(!key.empty() && key.find('/') == std::string_view::npos && key != "." && key[0] != '_',
          Errc::invalid_argument, "key '", key, "' cannot name ", what,
          ": it must be non-empty, contain no '/' and not start with '_'");
  require_name(key, cat("the key of ", what));
}

namespace {
using json = nlohmann::json;


json params_json(const std::vector<ParamRecord>& params) {
  json out = json::array();
  for (const ParamRecord& p : params) {
    json blocks = json::array();
    for (const Section& s : p.blocks) blocks.push_back({{"name", s.name}, {"rows", s.rows}});
    json record = {{"key", p.key}, {"tp_axis", tp_axis_name(p.tp_axis)}, {"blocks", blocks}, {"trailing", p.trailing}};
    // Written only when there are some, so that the records of a model without any read as before.
    if (!p.divisors.empty()) {
      json divisors = json::array();
      for (const TpDivisor& d : p.divisors) divisors.push_back({{"name", d.name}, {"count", d.count}});
      record["divisors"] = std::move(divisors);
    }
    out.push_back(std::move(record));
  }
  return out;
}

std::int64_t integer(const json& v, std::string_view what) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw std::invalid_argument(cat(what, " ", u, " is past the int64 range"));
    return static_cast<std::int64_t>(u);
  }
  if (!v.is_number_integer()) throw std::invalid_argument(cat(what, " is not an integer"));
  return v.get<std::int64_t>();
}

std::string string(const json& v, std::string_view what) {
  if (!v.is_string()) throw std::invalid_argument(cat(what, " is not a string"));
  return v.get<std::string>();
}

// An array of objects, each with exactly the fields `a` (a string) and `b` (an integer): the shape of
// a record's blocks and divisors.
std::vector<std::pair<std::string, std::int64_t>> named_integers(const json& v, std::string_view what,
                                                                 const char* a, const char* b) {
  if (!v.is_array()) throw std::invalid_argument(cat(what, " must be an array"));
  std::vector<std::pair<std::string, std::int64_t>> out;
  for (const json& e : v) {
    if (!e.is_object() || !e.contains(a) || !e.contains(b))
      throw std::invalid_argument(cat(what, ": an element is not an object with ", a, " and ", b));
    out.emplace_back(string(e[a], cat(what, ": a ", a)), integer(e[b], cat(what, ": ", b)));
  }
  return out;
}

ParamRecord record_from_json(const json& p) {
  if (!p.is_object() || !p.contains("key") || !p.contains("tp_axis") || !p.contains("blocks") ||
      !p.contains("trailing"))
    throw std::invalid_argument("a record is not an object with key, tp_axis, blocks and trailing");
  ParamRecord r;
  r.key = string(p["key"], "a record's key");
  r.tp_axis = parse_tp_axis(string(p["tp_axis"], cat(r.key, ": tp_axis")));
  for (auto& [name, rows] : named_integers(p["blocks"], cat(r.key, ": blocks"), "name", "rows"))
    r.blocks.push_back({std::move(name), rows});
  if (!p["trailing"].is_array()) throw std::invalid_argument(cat(r.key, ": trailing must be an array"));
  for (const json& t : p["trailing"]) r.trailing.push_back(integer(t, cat(r.key, ": a trailing dim")));
  // Optional: records written before divisors existed have none.
  if (p.contains("divisors"))
    for (auto& [name, count] : named_integers(p["divisors"], cat(r.key, ": divisors"), "name", "count"))
      r.divisors.push_back({std::move(name), count});
  return r;
}

}  // namespace

std::vector<ParamRecord> params_from_json(std::string_view text) {
  bool too_deep = false;
  const json in = json::parse(
      text,
      [&](int depth, json::parse_event_t, json&) {
        if (depth > 4) too_deep = true;
        return !too_deep;
      },
      true);
  if (too_deep) throw std::invalid_argument("nested deeper than parameter records are");
  if (!in.is_array()) throw std::invalid_argument("not a JSON array");
  std::vector<ParamRecord> out;
  std::set<std::string> keys;
  for (const json& p : in) {
    ParamRecord r = record_from_json(p);
    if (!keys.insert(r.key).second) throw std::invalid_argument(cat("parameter ", r.key, " is recorded twice"));
    // Non-empty blocks, positive sizes, unique names, no overflow; divisors named once each and positive.
    (void)spec_at_tp(r, 1);
    out.push_back(std::move(r));
  }
  return out;
}

std::string records_json(const std::vector<ParamRecord>& records) { return params_json(records).dump(); }

std::string inspect_json(const InspectReport& r) {
  json tensors = json::array(), params = json::array(), common = json::object(), skipped = json::array();
  for (const InspectReport::Tensor& t : r.tensors)
    tensors.push_back(
        {{"key", t.key}, {"dtype", dtype_name(t.dtype)}, {"global_shape", t.global_shape}, {"bytes", t.bytes}});
  for (const auto& [key, why] : r.skipped) skipped.push_back({{"key", key}, {"reason", why}});
  for (const ParamRecord& p : r.params) {
    json blocks = json::array();
    for (const Section& s : p.blocks)
      blocks.push_back({{"name", s.name}, {"key", block_key(p.key, s.name)}, {"rows", s.rows}});
    json divisors = json::array();
    for (const TpDivisor& d : p.divisors) divisors.push_back({{"name", d.name}, {"count", d.count}});
    params.push_back({{"key", p.key},
                      {"tp_axis", tp_axis_name(p.tp_axis)},
                      {"trailing", p.trailing},
                      {"blocks", blocks},
                      {"divisors", divisors}});
  }
  for (const auto& [key, value] : r.common) std::visit([&](const auto& v) { common[key] = v; }, value);
  return json{{"file", r.file.string()},
              {"format_version", r.format_version},
              {"kind", r.kind == CheckpointKind::global ? "global" : "local"},
              {"checkpoint_id", r.checkpoint_id},
              {"checksummed", r.checksummed},
              {"bytes", r.bytes},
              {"tensors", tensors},
              {"params", params},
              {"common", common},
              {"skipped", skipped}}
      .dump();
}

std::vector<ParamRecord> parse_records(std::string_view json_text) {
  try {
    return params_from_json(json_text);
  } catch (const Error& e) {
    throw Error(Errc::invalid_argument, cat("not valid parameter records: ", e.what()));
  } catch (const std::exception& e) {
    throw Error(Errc::invalid_argument, cat("not valid parameter records: ", e.what()));
  }
}

}  // namespace shardckpt
