// shardckpt inspect: the tensors, parameter records, common values and metadata of a checkpoint.
module;
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

using json = nlohmann::json;

std::int64_t dataset_bytes(const Dataset& d) {
  return element_bytes(d.dtype) * element_count(d.shape);
}

json inspect_json(const CheckpointReader& r, const std::string& file) {
  const CheckpointContents& c = r.contents();
  std::int64_t total = 0;
  json tensors = json::array(), params = json::array(), common = json::object(), skipped = json::array();
  for (const Dataset& d : r.datasets()) {
    total += dataset_bytes(d);
    tensors.push_back(
        {{"key", d.key}, {"dtype", dtype_name(d.dtype)}, {"global_shape", d.shape}, {"bytes", dataset_bytes(d)}});
  }
  for (const auto& [key, why] : r.skipped()) skipped.push_back({{"key", key}, {"reason", why}});
  for (const ParamRecord& p : r.params()) {
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
  for (const auto& [key, value] : c.common) std::visit([&](const auto& v) { common[key] = v; }, value);
  return {{"file", file},
          {"format_version", r.version()},
          {"kind", c.kind == CheckpointKind::global ? "global" : "local"},
          {"checkpoint_id", c.id},
          {"checksummed", r.checksummed()},
          {"bytes", total},
          {"tensors", tensors},
          {"params", params},
          {"common", common},
          {"skipped", skipped}};
}

void print_table(const CheckpointReader& r, const json& j) {
  std::printf("%s: %s checkpoint (format version %d%s), %zu tensors, %s\n", j["file"].get<std::string>().c_str(),
              j["kind"].get<std::string>().c_str(), r.version(),
              r.checksummed() ? ", checksummed" : ", no checksums", r.datasets().size(),
              mib_text(j["bytes"].get<std::int64_t>()).c_str());
  if (!r.contents().id.empty()) std::printf("  checkpoint id %s\n", r.contents().id.c_str());
  for (const Dataset& d : r.datasets())
    std::printf("  %-56s %-5s %-20s %12lld bytes\n", d.key.c_str(), std::string(dtype_name(d.dtype)).c_str(),
                dims_text(d.shape).c_str(), static_cast<long long>(dataset_bytes(d)));
  for (const auto& [key, why] : r.skipped()) std::printf("  %-56s skipped: %s\n", key.c_str(), why.c_str());
  if (!r.params().empty()) std::printf("fused layouts (global block rows):\n");
  for (const ParamRecord& p : r.params()) {
    std::printf("  %s (TP %s):", p.key.c_str(), std::string(tp_axis_name(p.tp_axis)).c_str());
    for (const Section& s : p.blocks)
      std::printf(" %s=%lld", s.name.empty() ? "(plain)" : s.name.c_str(), static_cast<long long>(s.rows));
    if (!p.divisors.empty()) std::printf(";  TP must divide");
    for (const TpDivisor& d : p.divisors) std::printf(" %s=%lld", d.name.c_str(), static_cast<long long>(d.count));
    std::printf("\n");
  }
  if (!r.contents().common.empty()) std::printf("common values:\n");
  for (const auto& [key, value] : j["common"].items()) std::printf("  %s = %s\n", key.c_str(), value.dump().c_str());
}

}  // namespace

Runner add_inspect(CLI::App& app, Global& global) {
  auto file = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("inspect", "list tensors, dtypes, global shapes, fused layouts and common values");
  cmd->add_option("file", *file, "checkpoint to inspect")->required();
  add_json(*cmd, global);
  return [file, &global] {
    const CheckpointReader reader(*file);
    const json j = inspect_json(reader, *file);
    if (global.json)
      print_json(j.dump());
    else
      print_table(reader, j);
    return success;
  };
}

}  // namespace shardckpt::cli
