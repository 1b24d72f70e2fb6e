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
module shardckpt.merge.seam;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.engine;
import shardckpt.state;
import shardckpt.storage;
import shardckpt.merge;
import :pieces;

namespace shardckpt {

namespace {

// Each piece of an entry is an item of the plan: a view of the shard's rows, never a copy.
void add_item(SavePlan& out, const PieceView<false>& piece) {
  out.items.push_back({std::string(piece.key), piece.dtype, {piece.global_shape.begin(), piece.global_shape.end()},
                       piece.box, piece.main, piece.rows});
}

void add_tensor_items(const ShardedTensor& t, bool share, SavePlan& out) {
  require(static_cast<bool>(t.data), Errc::invalid_argument, "tensor ", t.key, ": no data to save");
  require(t.data.dtype() == t.dtype && t.data.shape() == t.shape, Errc::shape_mismatch, "tensor ", t.key,
          ": the data does not match the declared dtype and shape");
  tensor_pieces(t, t.data.view(), own_rows(t.shape.rows(), t.replica_id, t.replicas, share),
                [&](const PieceView<false>& piece) { add_item(out, piece); });
}

void add_param_items(const ShardedParam& p, bool share, SavePlan& out) {
  const RankPlan plan = plan_rank(p.spec, p.gtp, p.align, p.coord);
  require(static_cast<bool>(p.shard), Errc::invalid_argument, p.describe(), ": no shard to save");
  const TensorView shard = p.shard.view();
  require(shard.dtype() == p.dtype, Errc::dtype_mismatch, p.describe(), ": the shard is ", dtype_name(shard.dtype()),
          ", declared ", dtype_name(p.dtype));
  require(shard.shape() == p.shard_shape(), Errc::shape_mismatch, p.describe(), ": the shard has shape ",
          dims_text(shard.shape().dims()), " but ", p.spec.rows(), " rows over ", p.gtp, " GTP ranks at alignment ",
          p.align, p.flat ? cat(" and flat range [", p.flat->begin, ", ", p.flat->end, ")") : std::string(),
          " give shards of shape ", dims_text(p.shard_shape().dims()));
  out.params.push_back(record_of(p.spec));
  param_pieces(p, plan, shard, own_rows(plan.real_rows, p.replica_id, p.replicas, share),
               [&](const PieceView<false>& piece) { add_item(out, piece); });
}

}  // namespace

SavePlan plan_save(const StateDict& state, bool share_replicas) {
  SavePlan out;
  for (const ShardedTensor& t : state.tensors()) add_tensor_items(t, share_replicas, out);
  for (const ShardedParam& p : state.params()) add_param_items(p, share_replicas, out);
  out.common = state.common();
  return out;
}

namespace {

// The dataset each writing item fills (null for an item that writes nothing), found once, before a
// byte is written: `datasets` in key order, as a skeleton lists them. Errc::missing_key names the
// first item without one.
std::vector<const Dataset*> datasets_of_items(const SavePlan& plan, std::span<const Dataset> datasets) {
  const auto by_key = [](const Dataset& a, const Dataset& b) { return a.key < b.key; };
  require(std::is_sorted(datasets.begin(), datasets.end(), by_key), Errc::internal,
          "the datasets of the checkpoint being written are not in key order");
  std::vector<const Dataset*> out(plan.items.size(), nullptr);
  for (std::size_t n = 0; n < plan.items.size(); ++n) {
    const SaveItem& i = plan.items[n];
    if (!i.writes) continue;
    const auto it = std::lower_bound(datasets.begin(), datasets.end(), i.key,
                                     [](const Dataset& d, const std::string& key) { return d.key < key; });
    require(it != datasets.end() && it->key == i.key, Errc::missing_key, "key ", i.key,
            " has no dataset in the checkpoint being written");
    out[n] = &*it;
  }
  return out;
}

}  // namespace

void write_items(const SavePlan& plan, std::span<const Dataset> datasets, PieceWriter& writer,
                 const std::shared_ptr<StagingPool>& staging, const RowsStaged& staged) {
  const std::vector<const Dataset*> dataset_of = datasets_of_items(plan, datasets);
  // Rows of device items staged in the pool, per buffer, in write order: a buffer's rows are written
  // once the engine has copied them, while it copies into the next buffer.
  struct Staged {
    const Dataset* dataset;
    Box box;
    MutTensorView rows;
    std::size_t item;
    std::int64_t first_row;
  };
  std::optional<Arena> arena;
  std::vector<std::vector<Staged>> pending;
  const auto write_buffer = [&](int b) {
    for (const Staged& s : pending[static_cast<std::size_t>(b)]) {
      if (staged) staged(s.item, s.first_row, s.rows);
      writer.write(*s.dataset, s.box, s.rows);
    }
    pending[static_cast<std::size_t>(b)].clear();
  };
  for (std::size_t n = 0; n < plan.items.size(); ++n) {
    const SaveItem& i = plan.items[n];
    if (!i.writes) continue;
    const Dataset* const dataset = dataset_of[n];
    if (i.data.space().host_accessible()) {
      if (arena) arena->drain(write_buffer);  // the file gets the items in order
      writer.write(*dataset, i.box, i.data);
      if (staged) staged(n, 0, i.data);
      continue;
    }
    if (!arena) {  // the caller's pool, or the library's for the device (device_staging)
      arena.emplace(staging ? staging : device_staging(i.data.space()));
      pending.resize(static_cast<std::size_t>(arena->buffers()));
    }
    for (std::int64_t r0 = 0; r0 < i.data.rows();) {
      const MutTensorView rows = arena->take(i.data, i.data.rows() - r0, write_buffer);
      arena->engine().copy_to_host(i.data.slice_rows(r0, r0 + rows.rows()), rows);
      pending[static_cast<std::size_t>(arena->current())].push_back(
          {dataset, {{i.box.rows.begin + r0, i.box.rows.begin + r0 + rows.rows()}, i.box.cols}, rows, n, r0});
      r0 += rows.rows();
    }
  }
  if (arena) arena->drain(write_buffer);
}

}  // namespace shardckpt
