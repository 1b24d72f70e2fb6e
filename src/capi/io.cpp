// The C API's saves and loads: one process (shardckpt::save without a group, a SoloGroup for a
// load), or several ranks as threads of this process (shardckpt::run_ranks). The collective work,
// its checks and its errors are the C++ library's.
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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

int shardckpt_read(const char* path, int64_t tp, int64_t tp_rank, int map, shardckpt_tensors** tensors,
                   shardckpt_values** values) {
  if (values) *values = nullptr;
  if (tensors == nullptr) return null_argument("shardckpt_read", "tensors");
  *tensors = nullptr;
  return guarded([&] {
    sc::ReadAll got = sc::read_all(path_of(path), {.tp = tp, .coord = {tp_rank, 0}}, {.map = map != 0});
    auto out = std::make_unique<shardckpt_tensors>(shardckpt_tensors{std::move(got.loaded), {}, {}});
    for (const std::string& key : out->loaded.keys()) {
      if (out->loaded.values().contains(key)) continue;
      const sc::Extents& shape = out->loaded.tensor(key).shape();
      std::vector<std::int64_t> dims;
      if (!got.scalars.contains(key)) dims.assign(shape.dims().begin(), shape.dims().end());
      out->shapes.emplace(key, std::move(dims));
      out->keys.push_back(key);
    }
    shardckpt_values* v = values ? values_of(out->loaded.values()) : nullptr;
    *tensors = out.release();
    if (values) *values = v;
  });
}

int shardckpt_inspect(const char* path, char** json) {
  if (json == nullptr) return null_argument("shardckpt_inspect", "json");
  *json = nullptr;
  return guarded([&] {
    const std::string from = path_of(path);
    sc::InspectReport report = sc::inspect_checkpoint(sc::CheckpointReader(from));
    report.file = from;
    const std::string text = sc::inspect_json(report);
    auto out = std::make_unique<char[]>(text.size() + 1);
    std::memcpy(out.get(), text.c_str(), text.size() + 1);
    *json = out.release();
  });
}

void shardckpt_string_free(char* text) { delete[] text; }

void shardckpt_tensors_free(shardckpt_tensors* tensors) { delete tensors; }

size_t shardckpt_tensors_count(const shardckpt_tensors* tensors) { return tensors ? tensors->keys.size() : 0; }

const char* shardckpt_tensors_key(const shardckpt_tensors* tensors, size_t index) {
  return tensors && index < tensors->keys.size() ? tensors->keys[index].c_str() : nullptr;
}

int shardckpt_tensors_get(shardckpt_tensors* tensors, const char* key, shardckpt_tensor* out) {
  if (tensors == nullptr) return null_argument("shardckpt_tensors_get", "tensors");
  if (key == nullptr) return null_argument("shardckpt_tensors_get", "key");
  if (out == nullptr) return null_argument("shardckpt_tensors_get", "out");
  return guarded([&] {
    const auto shape = tensors->shapes.find(std::string_view(key));
    sc::require(shape != tensors->shapes.end(), sc::Errc::missing_key, "tensor ", key, " is not in what was read");
    sc::SharedBuffer& b = tensors->loaded.tensor(key);
    *out = shardckpt_tensor{.dtype = static_cast<shardckpt_dtype>(b.dtype()),
                            .shape = shape->second.data(),
                            .rank = shape->second.size(),
                            .data = b.bytes() ? b.mut_view().data() : nullptr,
                            .bytes = b.bytes()};
  });
}

}  // extern "C"
