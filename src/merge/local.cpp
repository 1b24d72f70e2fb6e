module;
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.merge;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;
import shardckpt.merge.seam;

namespace shardckpt {
namespace {
namespace fs = std::filesystem;
}  // namespace

void save_local(const StateDict& state, const fs::path& path, IoMethod method) {
  const ForbidMaterialization no_copies;
  // A rank's own file holds all it has: replicas do not share the writing.
  const SavePlan plan = plan_save(state, false);
  std::vector<Dataset> specs;
  std::map<std::string, int> seen;
  std::int64_t checksum_rows = 0;
  for (const SaveItem& i : plan.items) {
    // Pieces of one key (the parts of a flat range) are told apart by a suffix; their placement says
    // where each goes.
    const int n = seen[i.key]++;
    const Box whole = whole_box(i.data.shape().dims());
    specs.push_back({n ? cat(i.key, "@", n) : i.key, i.dtype, i.data.shape().to_vector(),
                     PiecePlacement{i.key, i.global_shape, i.box}, {}, {}});
    if (!whole.empty()) specs.back().slabs.push_back({whole, checksum_rows});
    checksum_rows += checksum_rows_of(whole);
  }
  try {
    CheckpointWriter checkpoint = CheckpointWriter::create(
        io::Destination::of(path), specs, {CheckpointKind::local, plan.params, plan.common, io::random_id()}, checksum_rows);
    PieceWriter writer = checkpoint.pieces(method, 0);
    for (std::size_t n = 0; n < plan.items.size(); ++n)
      writer.write(checkpoint.skeleton().datasets[n], whole_box(plan.items[n].data.shape().dims()), plan.items[n].data);
    std::move(checkpoint).written(writer.finish()).seal().commit();
  } catch (Error& e) {
    throw std::move(e.add_context(cat("while saving the local checkpoint ", path.string())));
  }
}

Values load_local_into(const fs::path& path, StateDict& state, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  return load_with(reader, state, options, CheckpointKind::local);
}

LoadedState load_local(const fs::path& path, const StateDict& request, LoadOptions options) {
  Allocated a = allocate_destinations(request);
  Values values = load_local_into(path, a.state, options);
  return LoadedState(std::move(a.buffers), std::move(values));
}

}  // namespace shardckpt
