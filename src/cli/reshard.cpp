// shardckpt reshard: load a checkpoint at a layout, from its own records, and save it again.
module;
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
module shardckpt.cli;

namespace shardckpt::cli {
namespace {

struct ReshardFlags {
  std::string in, out;
  LayoutFlags layout;
  bool no_checksums = false;
};

}  // namespace

Runner add_reshard(CLI::App& app, Global& global) {
  auto f = std::make_shared<ReshardFlags>();
  auto* cmd = app.add_subcommand("reshard", "load a checkpoint at a layout (thread ranks) and save it again");
  cmd->add_option("in", f->in, "checkpoint to read")->required();
  cmd->add_option("out", f->out, "checkpoint to write")->required();
  f->layout.add(*cmd, false);
  cmd->add_flag("--no-checksums", f->no_checksums, "do not check the bytes read against their checksums");
  add_json(*cmd, global);
  return [f, &global] {
    const demo::Layout layout = f->layout.resolve();
    const CheckpointReader reader(f->in);
    require_memory(reader, layout, false, false);
    std::int64_t bytes = 0;
    for (const Dataset& d : reader.datasets())
      bytes += element_count(d.shape) * element_bytes(d.dtype);
    const auto t0 = std::chrono::steady_clock::now();
    {
      ProgressLine loading("loading", bytes, global), saving("saving ", bytes, global);
      run_ranks(layout.ranks(), [&](ProcessGroup& group) {
        const ShardCoord coord{group.rank() / layout.gtp, group.rank() % layout.gtp};
        const StateDict request = request_all(reader, {layout.tp, layout.gtp, layout.align, coord, 0});
        // Records, common values and tensor bytes all come through the one open reader.
        const LoadedState loaded =
            load(reader, request, group, {.verify_checksums = !f->no_checksums, .progress = loading.callback()});
        StateDict state;
        for (const ShardedParam& p : request.params()) {
          ShardedParam entry = p;
          entry.shard = TensorRef::read_only(loaded.tensor(p.spec.key));
          state.add(std::move(entry));
        }
        for (const ShardedTensor& t : request.tensors()) {  // scalars: every rank holds one, one writes it
          ShardedTensor entry = t;
          entry.data = TensorRef::read_only(loaded.tensor(t.key));
          entry.replica_id = group.rank();
          entry.replicas = group.size();
          state.add(std::move(entry));
        }
        for (const auto& [key, value] : loaded.values()) state.add_common(key, value);
        save(state, f->out, group, {.progress = saving.callback()});
      });
    }
    const double seconds = seconds_since(t0);
    if (global.json)
      print_json(nlohmann::json{{"in", f->in},
                                {"out", f->out},
                                {"layout", demo::layout_json(layout)},
                                {"parameters", reader.params().size()},
                                {"tensors", reader.datasets().size()},
                                {"bytes", bytes},
                                {"checksums_checked", reader.checksummed() && !f->no_checksums},
                                {"seconds", seconds}}
                     .dump());
    else
      std::printf("resharded %s -> %s at %s: %zu tensors, %s in %.3f s%s\n", f->in.c_str(), f->out.c_str(),
                  demo::layout_text(layout).c_str(), reader.datasets().size(), mib_text(bytes).c_str(), seconds,
                  reader.checksummed() && !f->no_checksums ? "; every byte read matched its checksum" : "");
    return success;
  };
}

}  // namespace shardckpt::cli
