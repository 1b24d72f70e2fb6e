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
module shardckpt.state;

namespace shardckpt {

std::string ShardedParam::describe() const {
  return cat("parameter ", spec.key, " (TP rank ", coord.tp_rank, ", GTP rank ", coord.gtp_rank, ")");
}

ShardedTensor ShardedTensor::of(std::string key, TensorRef data, std::vector<std::int64_t> global_shape,
                                std::vector<std::int64_t> global_offset, int replica_id, int replicas) {
  const DType dtype = data.dtype();
  const Extents shape = data.shape();
  return {std::move(key),           dtype,      shape,    std::move(global_shape),
          std::move(global_offset), replica_id, replicas, std::move(data)};
}

ShardedTensor ShardedTensor::expect(std::string key, DType dtype, Extents shape, std::vector<std::int64_t> global_shape,
                                    std::vector<std::int64_t> global_offset, int replica_id, int replicas) {
  if (global_shape.empty() && shape.rank() == 0) shape = Extents{1};
  return {std::move(key), dtype, shape, std::move(global_shape), std::move(global_offset), replica_id, replicas, {}};
}

Extents ShardedParam::padded_shape() const {
  std::vector<std::int64_t> dims{geometry().shard_rows()};
  dims.insert(dims.end(), spec.trailing.begin(), spec.trailing.end());
  return Extents(std::span<const std::int64_t>(dims));
}

Extents ShardedParam::shard_shape() const {
  if (!flat) return padded_shape();
  return {flat->end - flat->begin};
}

Range distributed_range(const ShardedParam& param, int rank, int ranks) {
  const Range r = balanced_share(param.padded_shape().elements(), ranks, rank);
  return {r.begin, r.end};
}

ShardedParam optimizer_state(const ShardedParam& param, std::string_view name, DType dtype) {
  require_name(name, "an optimizer state's name");
  ShardedParam out = param;
  out.spec.key = cat(optimizer_state_prefix, name, ".", param.spec.key);
  out.dtype = dtype;
  out.shard = {};
  return out;
}

void StateDict::claim_key(const std::string& key) {
  require_name(key, "a state dict key");
  require(keys_.emplace(key, -1).second, Errc::invalid_argument, "key ", key, " appears twice in the state dict");
}

void StateDict::add(ShardedTensor tensor) {
  if (tensor.scalar()) {
    if (tensor.shape.rank() == 0) tensor.shape = Extents{1};
    require(tensor.shape == Extents{1} && tensor.global_offset.empty(), Errc::invalid_argument, "tensor ", tensor.key,
            ": a scalar (global shape []) is one element: its shard has shape [1] (or []) and its global offset is "
            "[], not ", dims_text(tensor.shape.dims()), " at ", dims_text(tensor.global_offset));
  }
  require(tensor.scalar() || (static_cast<std::size_t>(tensor.shape.rank()) == tensor.global_shape.size() &&
                              tensor.global_offset.size() == tensor.global_shape.size()),
          Errc::invalid_argument, "tensor ", tensor.key, ": shard, global shape and offset must have the same rank");
  require(tensor.replicas >= 1 && tensor.replica_id >= 0 && tensor.replica_id < tensor.replicas, Errc::invalid_argument,
          "tensor ", tensor.key, ": replica ", tensor.replica_id, " of ", tensor.replicas);
  // A key may name several parts of one tensor a rank holds (the layers of a layer-stacked weight):
  // the same dataset, so the same global shape and dtype.
  const auto it = keys_.find(tensor.key);
  if (it != keys_.end() && it->second >= 0) {
    const ShardedTensor& first = tensors_[static_cast<std::size_t>(it->second)];
    require(!tensor.scalar() && first.global_shape == tensor.global_shape && first.dtype == tensor.dtype,
            Errc::invalid_argument, "tensor ", tensor.key, ": another part of it on this rank is ",
            dtype_name(first.dtype), " of global shape ", dims_text(first.global_shape), ", this one ",
            dtype_name(tensor.dtype), " of global shape ", dims_text(tensor.global_shape),
            " (the parts of one key are one dataset)");
  } else {
    claim_key(tensor.key);
    keys_[tensor.key] = static_cast<int>(tensors_.size());
  }
  tensors_.push_back(std::move(tensor));
}

CheckedParam check_param(ShardedParam param) {
  validate(param.spec);
  const RankPlan plan = plan_rank(param.spec, param.gtp, param.align, param.coord);  // rejects bad coordinates and geometry now
  require(param.replicas >= 1 && param.replica_id >= 0 && param.replica_id < param.replicas, Errc::invalid_argument,
          param.describe(), ": replica ", param.replica_id, " of ", param.replicas);
  if (param.flat)
    require(param.flat->begin >= 0 && param.flat->begin <= param.flat->end &&
                param.flat->end <= param.padded_shape().elements(),
            Errc::invalid_argument, param.describe(), ": flat range [", param.flat->begin, ", ", param.flat->end,
            ") is outside its shard of ", param.padded_shape().elements(), " elements");
  return CheckedParam(std::move(param), plan.real_rows);
}

void StateDict::add(ShardedParam param) { add(check_param(std::move(param))); }

void StateDict::add(CheckedParam param) {
  claim_key(param.param_.spec.key);
  params_.push_back(std::move(param.param_));
}

void StateDict::add_common(std::string key, CommonValue value) {
  if (const auto* text = std::get_if<std::string>(&value)) require_text(key, *text);
  claim_key(key);
  common_.emplace(std::move(key), std::move(value));
}

void StateDict::add_local(std::string key, CommonValue value) {
  claim_key(key);
  local_.emplace(std::move(key), std::move(value));
}

TensorRef& StateDict::mut_data(std::size_t i) {
  require(i < tensors_.size(), Errc::invalid_argument, "tensor ", i, " of a state dict of ", tensors_.size(), " tensors");
  return tensors_[i].data;
}

TensorRef& StateDict::mut_shard(std::size_t i) {
  require(i < params_.size(), Errc::invalid_argument, "parameter ", i, " of a state dict of ", params_.size(),
          " parameters");
  return params_[i].shard;
}

std::vector<std::string> LoadedState::keys() const {
  std::vector<std::string> out;
  for (const auto& [key, t] : tensors_) out.push_back(key);
  for (const auto& [key, v] : values_) out.push_back(key);
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

template <class Map>
auto& find_tensor(Map& tensors, std::string_view key) {
  const auto it = tensors.find(key);
  require(it != tensors.end(), Errc::missing_key, "no tensor ", key, " in the loaded state");
  return it->second;
}

}  // namespace

const SharedBuffer& LoadedState::tensor(std::string_view key) const& { return find_tensor(tensors_, key); }

SharedBuffer& LoadedState::tensor(std::string_view key) & { return find_tensor(tensors_, key); }

const CommonValue& LoadedState::value(std::string_view key) const {
  const auto it = values_.find(key);
  require(it != values_.end(), Errc::missing_key, "no value ", key, " in the loaded state");
  return it->second;
}

}  // namespace shardckpt
