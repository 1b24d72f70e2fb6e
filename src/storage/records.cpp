module;
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
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
}

namespace {
using json = nlohmann::json;


json params_json(const std::vector<ParamRecord>& params) {
  json out = json::array();
  for (const ParamRecord& p : params) {
    json blocks = json::array();
    for (const Section& s : p.blocks) blocks.push_back({{"name", s.name}, {"rows", s.rows}});
    out.push_back({{"key", p.key}, {"tp_axis", tp_axis_name(p.tp_axis)}, {"blocks", blocks}, {"trailing", p.trailing}});
  }
  return out;
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
  const auto integer = [](const json& v, std::string_view what) {
    if (v.is_number_unsigned()) {
      const auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        throw std::invalid_argument(cat(what, " ", u, " is past the int64 range"));
      return static_cast<std::int64_t>(u);
    }
    if (!v.is_number_integer()) throw std::invalid_argument(cat(what, " is not an integer"));
    return v.get<std::int64_t>();
  };
  const auto string = [](const json& v, std::string_view what) {
    if (!v.is_string()) throw std::invalid_argument(cat(what, " is not a string"));
    return v.get<std::string>();
  };
  std::vector<ParamRecord> out;
  std::set<std::string> keys;
  for (const json& p : in) {
    if (!p.is_object() || !p.contains("key") || !p.contains("tp_axis") || !p.contains("blocks") ||
        !p.contains("trailing"))
      throw std::invalid_argument("a record is not an object with key, tp_axis, blocks and trailing");
    ParamRecord r;
    r.key = string(p["key"], "a record's key");
    r.tp_axis = parse_tp_axis(string(p["tp_axis"], cat(r.key, ": tp_axis")));
    if (!p["blocks"].is_array() || !p["trailing"].is_array())
      throw std::invalid_argument(cat(r.key, ": blocks and trailing must be arrays"));
    for (const json& b : p["blocks"]) {
      if (!b.is_object() || !b.contains("name") || !b.contains("rows"))
        throw std::invalid_argument(cat(r.key, ": a block is not an object with name and rows"));
      r.blocks.push_back({string(b["name"], cat(r.key, ": a block name")), integer(b["rows"], cat(r.key, ": rows"))});
    }
    for (const json& t : p["trailing"]) r.trailing.push_back(integer(t, cat(r.key, ": a trailing dim")));
    if (!keys.insert(r.key).second) throw std::invalid_argument(cat("parameter ", r.key, " is recorded twice"));
    (void)spec_at_tp(r, 1);  // non-empty blocks, positive sizes, unique names, no overflow
    out.push_back(std::move(r));
  }
  return out;
}

std::string records_json(const std::vector<ParamRecord>& records) { return params_json(records).dump(); }

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
