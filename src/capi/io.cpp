// The C API's saves and loads: one process (shardckpt::save without a group, a SoloGroup for a
// load), or several ranks as threads of this process (shardckpt::run_ranks). The collective work,
// its checks and its errors are the C++ library's.
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>
#include "handles.hpp"

namespace shardckpt::capi {
namespace {

// Throws Errc::invalid_argument unless `states` holds `ranks` (at least one) non-null states.
std::span<shardckpt_state* const> rank_states(shardckpt_state* const* states, int ranks) {
  require(states != nullptr, Errc::invalid_argument, "states is NULL");
  require(ranks >= 1, Errc::invalid_argument, "ranks is ", ranks, ": give at least one state");
  const std::span<shardckpt_state* const> all(states, static_cast<std::size_t>(ranks));
  for (std::size_t r = 0; r < all.size(); ++r)
    require(all[r] != nullptr, Errc::invalid_argument, "the state of rank ", r, " is NULL");
  return all;
}

}  // namespace
}  // namespace shardckpt::capi

using namespace shardckpt::capi;
namespace sc = shardckpt;

extern "C" {

int shardckpt_save(const shardckpt_state* state, const char* path) {
  if (state == nullptr) return null_argument("shardckpt_save", "state");
  return guarded([&] { sc::save(state->dict, path_of(path)); });
}

int shardckpt_save_ranks(shardckpt_state* const* states, int ranks, const char* path) {
  return guarded([&] {
    const auto all = rank_states(states, ranks);
    const std::string to = path_of(path);
    sc::run_ranks(ranks, [&](sc::ProcessGroup& group) { sc::save(all[group.rank()]->dict, to, group); });
  });
}

int shardckpt_load_into(const char* path, shardckpt_state* state, shardckpt_values** values) {
  if (values) *values = nullptr;
  if (state == nullptr) return null_argument("shardckpt_load_into", "state");
  return guarded([&] {
    sc::SoloGroup group;
    sc::Values loaded = sc::load_into(path_of(path), state->dict, group);
    if (values) *values = values_of(std::move(loaded));
  });
}

int shardckpt_load_into_ranks(const char* path, shardckpt_state* const* states, int ranks, shardckpt_values** values) {
  if (values) *values = nullptr;
  return guarded([&] {
    const auto all = rank_states(states, ranks);
    const std::string from = path_of(path);
    std::optional<sc::Values> first;  // rank 0's: every rank gets the same
    sc::run_ranks(ranks, [&](sc::ProcessGroup& group) {
      sc::Values loaded = sc::load_into(from, all[group.rank()]->dict, group);
      if (group.rank() == 0) first = std::move(loaded);
    });
    if (values) *values = values_of(std::move(*first));
  });
}

}  // extern "C"
