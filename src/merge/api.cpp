// shardckpt.merge: the plan of a save as a user sees it (prepare_save, claims_of); the rest of the
// module's installed interface is defined where its work is (request.cpp, local.cpp), and the work
// of saves and loads in shardckpt.merge.seam (save.cpp, load.cpp).
module;
#include <cstdint>
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

SavePlan prepare_save(const StateDict& state) { return plan_save(state, true); }

std::vector<Claim> claims_of(const SavePlan& plan, int rank) {
  std::vector<Claim> out;
  out.reserve(plan.items.size());
  for (const SaveItem& i : plan.items) out.push_back({i.key, i.dtype, i.global_shape, i.box, rank, i.writes});
  return out;
}

}  // namespace shardckpt
