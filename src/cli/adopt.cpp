// shardckpt adopt: make a plain HDF5 file (h5py's, say) with the non-GTP keys and shapes loadable as
// a checkpoint, without rewriting its data: a small checkpoint beside it holds the parameter
// records, the slab table and the checksum of every row, and points at the file's bytes.
module;
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

struct AdoptFlags {
  std::string file;
  std::string model_config;
  std::string out;
};

struct Model {
  std::vector<ParamRecord> records;
  Values common;
};

// A JSON array of parameter records (docs/format.md), or a demo model config (whose checkpoints
// then verify against the demo pattern).
Model model_of(const std::string& path) {
  std::ifstream in(path);
  require(in.good(), Errc::invalid_argument, "--model-config: cannot read ", path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string json = text.str();
  if (json.find_first_not_of(" \t\r\n") != std::string::npos && json[json.find_first_not_of(" \t\r\n")] == '[')
    return {parse_records(json), {}};
  CheckpointContents contents;
  contents.common.emplace("model_config", json);
  const std::optional<demo::ModelConfig> config = demo::config_of(contents);
  require(config.has_value(), Errc::invalid_argument, "--model-config ", path,
          " holds neither a JSON array of parameter records nor a demo model config");
  Model m;
  for (const ParamSpec& spec : demo::params(*config, 1)) m.records.push_back(record_of(spec));
  m.common.emplace("model_config", json);
  return m;
}

}  // namespace

Runner add_adopt(CLI::App& app, Global& global) {
  auto f = std::make_shared<AdoptFlags>();
  auto* cmd = app.add_subcommand("adopt", "make a plain HDF5 file (non-GTP keys and shapes) loadable, without "
                                          "rewriting its data");
  cmd->add_option("file", f->file, "the plain HDF5 file (contiguous datasets at the root)")->required();
  cmd->add_option("--model-config", f->model_config,
                  "JSON file: the parameter records (docs/format.md) or a demo model config")
      ->required();
  cmd->add_option("--out", f->out, "the checkpoint to write, beside FILE (default: FILE's stem + .shardckpt.h5)");
  add_json(*cmd, global);
  return [f, &global] {
    const Model m = model_of(f->model_config);
    const std::filesystem::path file = f->file;
    const std::filesystem::path out =
        f->out.empty() ? file.parent_path() / (file.stem().string() + ".shardckpt.h5") : std::filesystem::path(f->out);
    const AdoptReport r = adopt(file, out, m.records, m.common);
    if (global.json)
      print_json(nlohmann::json{
          {"file", f->file}, {"out", out.string()}, {"tensors", r.tensors}, {"params", r.params}, {"bytes", r.bytes}}
                     .dump());
    else
      std::printf("adopted %s as %s: %lld tensors (%lld parameter records), %s checksummed; the bytes stay in %s\n",
                  f->file.c_str(), out.c_str(), static_cast<long long>(r.tensors), static_cast<long long>(r.params),
                  mib_text(r.bytes).c_str(), f->file.c_str());
    return success;
  };
}

}  // namespace shardckpt::cli
