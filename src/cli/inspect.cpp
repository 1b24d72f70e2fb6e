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

void print_table(const InspectReport& r) {
  std::printf("%s: %s checkpoint (format version %d%s), %zu tensors, %s\n", r.file.c_str(),
              r.kind == CheckpointKind::global ? "global" : "local", r.format_version,
              r.checksummed ? ", checksummed" : ", no checksums", r.tensors.size(), mib_text(r.bytes).c_str());
  if (!r.checkpoint_id.empty()) std::printf("  checkpoint id %s\n", r.checkpoint_id.c_str());
  for (const InspectReport::Tensor& t : r.tensors)
    std::printf("  %-56s %-5s %-20s %12lld bytes\n", t.key.c_str(), std::string(dtype_name(t.dtype)).c_str(),
                dims_text(t.global_shape).c_str(), static_cast<long long>(t.bytes));
  for (const auto& [key, why] : r.skipped) std::printf("  %-56s skipped: %s\n", key.c_str(), why.c_str());
  if (!r.params.empty()) std::printf("fused layouts (global block rows):\n");
  for (const ParamRecord& p : r.params) {
    std::printf("  %s (TP %s):", p.key.c_str(), std::string(tp_axis_name(p.tp_axis)).c_str());
    for (const Section& s : p.blocks)
      std::printf(" %s=%lld", s.name.empty() ? "(plain)" : s.name.c_str(), static_cast<long long>(s.rows));
    if (!p.divisors.empty()) std::printf(";  TP must divide");
    for (const TpDivisor& d : p.divisors) std::printf(" %s=%lld", d.name.c_str(), static_cast<long long>(d.count));
    std::printf("\n");
  }
  if (!r.common.empty()) std::printf("common values:\n");
  for (const auto& [key, value] : r.common) {  // each as JSON writes it (strings quoted), as --json does
    const std::string text = std::visit([](const auto& v) { return nlohmann::json(v).dump(); }, value);
    std::printf("  %s = %s\n", key.c_str(), text.c_str());
  }
}

}  // namespace

Runner add_inspect(CLI::App& app, Global& global) {
  auto file = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("inspect", "list tensors, dtypes, global shapes, fused layouts and common values");
  cmd->add_option("file", *file, "checkpoint to inspect")->required();
  add_json(*cmd, global);
  return [file, &global] {
    InspectReport report = inspect_checkpoint(CheckpointReader(*file));
    report.file = *file;
    if (global.json)
      print_json(inspect_json(report));
    else
      print_table(report);
    return success;
  };
}

}  // namespace shardckpt::cli
