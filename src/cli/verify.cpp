// shardckpt verify: read every byte of every tensor of any checkpoint and check it against its
// checksum.
module;
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
module shardckpt.cli;

namespace shardckpt::cli {

Runner add_verify(CLI::App& app, Global& global) {
  auto file = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("verify", "check every byte of every tensor against its checksum (exit 1 if any differs)");
  cmd->add_option("file", *file, "checkpoint to verify")->required();
  add_json(*cmd, global);
  return [file, &global] {
    const CheckpointReader reader(*file);
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t reported = 0;
    VerifyReport r;
    {
      std::int64_t total = 0;
      for (const Dataset& d : reader.datasets())
        total += element_count(d.shape) * element_bytes(d.dtype);
      ProgressLine progress("verifying", total, global);
      r = verify_checkpoint(reader, [&](std::int64_t done, std::int64_t) {
        progress.add(done - reported);
        reported = done;
      });
    }
    const double seconds = seconds_since(t0);
    const bool ok = r.checksummed && r.mismatches == 0;
    if (global.json) {
      print_json(nlohmann::json{{"file", *file},
                                {"format_version", reader.version()},
                                {"checksummed", r.checksummed},
                                {"datasets", r.datasets},
                                {"bytes", r.bytes},
                                {"rows_checked", r.checksum_rows},
                                {"mismatches", r.mismatches},
                                {"problems", r.problems},
                                {"seconds", seconds},
                                {"verified", ok}}
                     .dump());
    } else if (!r.checksummed) {
      std::printf("%s: %lld tensors, %s: no checksums (%s), nothing verified\n", file->c_str(),
                  static_cast<long long>(r.datasets), mib_text(r.bytes).c_str(),
                  reader.version() < 2 ? "written before checksums existed" : "saved without them");
    } else {
      std::printf("%s: %lld tensors, %s, %lld rows checked in %.3f s: %s\n", file->c_str(),
                  static_cast<long long>(r.datasets), mib_text(r.bytes).c_str(), static_cast<long long>(r.checksum_rows),
                  seconds, r.mismatches ? "MISMATCH" : "every byte matches its checksum");
    }
    for (const std::string& p : r.problems) std::cerr << "shardckpt: " << p << "\n";
    if (r.mismatches > static_cast<std::int64_t>(r.problems.size()))
      std::cerr << "shardckpt: ... " << r.mismatches << " mismatching rows in all\n";
    return ok ? success : mismatch;
  };
}

}  // namespace shardckpt::cli
