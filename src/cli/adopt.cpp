// shardckpt adopt: make a plain HDF5 file (h5py's, say) or a safetensors file (PyTorch's, through
// Hugging Face's safetensors) with the non-GTP keys and shapes loadable as a checkpoint, without
// rewriting its data: a small checkpoint beside it holds the parameter records, the common values,
// the slab table and the checksum of every row, and points at the file's bytes.
module;
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <variant>
#include <vector>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

struct AdoptFlags {
  std::string file;
  std::string model_config;
  std::string out;
  std::vector<std::string> common;
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

// Longer attribute names are more than HDF5 stores in one object header message.
constexpr std::size_t max_common_key = 1024;

bool digits(std::string_view s) { return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos; }

// [+-]digits: an int64 literal.
bool integer_literal(std::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  return digits(s);
}

// [+-](digits[.digits] | .digits)[(e|E)[+-]digits], with a point or an exponent: a double literal.
bool float_literal(std::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  const std::size_t e = s.find_first_of("eE");
  std::string_view mantissa = s.substr(0, e), exponent = e == std::string_view::npos ? "" : s.substr(e + 1);
  const std::size_t point = mantissa.find('.');
  const std::string_view whole = mantissa.substr(0, point);
  const std::string_view part = point == std::string_view::npos ? "" : mantissa.substr(point + 1);
  const bool numeral = (whole.empty() || digits(whole)) && (part.empty() || digits(part)) && !(whole.empty() && part.empty());
  if (e != std::string_view::npos && !exponent.empty() && (exponent[0] == '+' || exponent[0] == '-'))
    exponent.remove_prefix(1);
  return numeral && (point != std::string_view::npos || e != std::string_view::npos) &&
         (e == std::string_view::npos || digits(exponent));
}

// A --common value, typed by its text: an integer literal is an int64, a decimal float literal a
// double, text in double quotes the string between them, and anything else the string itself.
CommonValue common_value(std::string_view flag, std::string_view text) {
  const auto bad = [&](std::string_view why) {
    throw Error(Errc::invalid_argument, cat("--common ", flag, ": ", why, " (put it in double quotes to store it as a string)"));
  };
  if (text.size() >= 2 && text.front() == '"' && text.back() == '"') return std::string(text.substr(1, text.size() - 2));
  const std::string_view number = !text.empty() && text[0] == '+' ? text.substr(1) : text;
  if (integer_literal(text)) {
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec != std::errc{} || end != number.data() + number.size()) bad("the integer is outside the int64 range");
    return v;
  }
  if (float_literal(text)) {
    double v = 0;
    const auto [end, ec] = std::from_chars(number.data(), number.data() + number.size(), v);
    if (ec != std::errc{} || end != number.data() + number.size() || !std::isfinite(v))
      bad("the number is outside the range of a double");
    return v;
  }
  return std::string(text);
}

// Every --common key=value, added to what the model config holds; a key given twice is an error.
void add_common(const std::vector<std::string>& flags, Values& common) {
  Values given;
  for (const std::string& flag : flags) {
    const std::size_t eq = flag.find('=');
    require(eq != std::string::npos && eq > 0, Errc::invalid_argument, "--common ", flag,
            ": not key=value (an int, a float or a string)");
    const std::string key = flag.substr(0, eq);
    require(key.size() <= max_common_key, Errc::invalid_argument, "--common: a key of ", key.size(),
            " bytes is longer than ", max_common_key);
    require(!given.contains(key), Errc::invalid_argument, "--common ", key, " is given twice");
    require(!common.contains(key), Errc::invalid_argument, "--common ", key, ": the demo model config sets it");
    given.emplace(key, common_value(flag, std::string_view(flag).substr(eq + 1)));
  }
  common.merge(given);
}

}  // namespace

Runner add_adopt(CLI::App& app, Global& global) {
  auto f = std::make_shared<AdoptFlags>();
  auto* cmd = app.add_subcommand("adopt", "make a plain HDF5 or safetensors file (non-GTP keys and shapes) loadable, "
                                          "without rewriting its data");
  cmd->add_option("file", f->file, "the plain HDF5 file (contiguous datasets at the root) or safetensors file")
      ->required();
  cmd->add_option("--model-config", f->model_config,
                  "JSON file: the parameter records (docs/format.md) or a demo model config")
      ->required();
  cmd->add_option("--out", f->out, "the checkpoint to write, beside FILE (default: FILE's stem + .shardckpt.h5)");
  cmd->add_option("--common", f->common,
                  "KEY=VALUE, repeatable: a common value of the checkpoint; an int64 or double literal is "
                  "that number, \"text\" in double quotes and anything else a string")
      ->expected(1)
      ->allow_extra_args(false)
      ->take_all();
  add_json(*cmd, global);
  return [f, &global] {
    Model m = model_of(f->model_config);
    add_common(f->common, m.common);
    const std::filesystem::path file = f->file;
    const std::filesystem::path out =
        f->out.empty() ? file.parent_path() / (file.stem().string() + ".shardckpt.h5") : std::filesystem::path(f->out);
    const AdoptReport r = adopt(file, out, m.records, m.common);
    if (global.json)
      print_json(nlohmann::json{{"file", f->file},
                                {"out", out.string()},
                                {"tensors", r.tensors},
                                {"params", r.params},
                                {"fused", r.fused},
                                {"common", m.common.size()},
                                {"bytes", r.bytes}}
                     .dump());
    else
      std::printf("adopted %s as %s: %lld tensors (%lld parameter records, %lld fused tensors cut into blocks), "
                  "%zu common values, %s checksummed; the bytes stay in %s\n",
                  f->file.c_str(), out.c_str(), static_cast<long long>(r.tensors), static_cast<long long>(r.params),
                  static_cast<long long>(r.fused), m.common.size(), mib_text(r.bytes).c_str(), f->file.c_str());
    return success;
  };
}

}  // namespace shardckpt::cli
