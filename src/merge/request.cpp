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

StateDict request_all(const CheckpointReader& reader, const LoadLayout& layout) {
  StateDict out;
  std::set<std::string, std::less<>> covered;
  const auto add = [&](const ParamRecord& record, DType dtype) {
    ShardedParam p{spec_at_tp(record, layout.tp), layout.gtp, layout.align, layout.coord, dtype};
    if (layout.distributed_optimizer && record.key.starts_with(optimizer_state_prefix)) {
      p.flat = distributed_range(p, layout.replica_id, layout.replicas);
    } else {
      p.replica_id = layout.replica_id;
      p.replicas = layout.replicas;
    }
    out.add(std::move(p));
  };
  for (const ParamRecord& r : reader.params()) {
    for (const Section& b : r.blocks) covered.insert(block_key(r.key, b.name));
    add(r, reader.dataset(block_key(r.key, r.blocks.front().name)).dtype);
  }
  for (const Dataset& d : reader.datasets()) {
    if (covered.contains(d.key)) continue;
    if (d.shape.empty())  // a scalar: one element, the same for every rank
      out.add(ShardedTensor::expect(d.key, d.dtype, {1}, {}, {}, layout.replica_id, layout.replicas));
    else if (d.shape[0] > 0)
      add({d.key, TpAxis::replicated, plain_sections(d.shape[0]), {d.shape.begin() + 1, d.shape.end()}, {}}, d.dtype);
  }
  return out;
}

ReadAll read_all(const std::filesystem::path& path, const LoadLayout& layout, LoadOptions options) {
  const CheckpointReader reader(path);
  notice_unchecked(reader, options);
  const StateDict request = request_all(reader, layout);
  std::set<std::string, std::less<>> scalars;
  for (const ShardedTensor& t : request.tensors())
    if (t.scalar()) scalars.insert(t.key);
  return {load_new(reader, request, options), std::move(scalars)};
}

}  // namespace shardckpt
