// Checkpoints of a training loop (docs/user-guide.md, "A training loop"): each rank's weights and
// Adam state live in device memory the trainer allocated; every 10 steps a Saver saves them in the
// background, streaming them through a small host budget while the next step's forward and backward
// run, and the optimizer step waits until the save has read them; a restart at another layout loads
// them in place into the new job's own device tensors. The device here is emulated (its memory is unreadable from the host, as
// a GPU's is); on a GPU it is `std::make_shared<sc::CudaEngine>(local_rank)` from `import shardckpt.cuda;`.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>
import shardckpt;

namespace sc = shardckpt;

// One fused in_proj weight as TP rank coord.tp_rank of `tp` holds it, GTP-sharded.
sc::ShardedParam in_proj(std::int64_t tp, std::int64_t gtp, std::int64_t align, sc::ShardCoord coord) {
  const sc::SsmDims dims{.heads = 4, .head_dim = 8, .groups = 2, .state = 8, .householder = 2};
  const sc::ParamSpec spec{.key = "layers.0.in_proj.weight",
                           .sections = sc::gdp_in_proj_sections(dims, tp),
                           .trailing = {64},
                           .tp_axis = sc::TpAxis::rows,
                           .tp = tp,
                           .divisors = sc::ssm_divisors(dims)};
  return {.spec = spec, .gtp = gtp, .align = align, .coord = coord, .dtype = sc::DType::bf16};
}

// The trainer's tensors on one rank: the weight (bf16) and Adam's state (f32, same layout), each a
// buffer of device memory the state dict shares the ownership of.
std::vector<sc::ShardedParam> model(sc::CopyEngine& device, const sc::ShardedParam& weight) {
  std::vector<sc::ShardedParam> out{weight};
  for (const char* name : {"exp_avg", "exp_avg_sq", "fp32_param"})
    out.push_back(sc::optimizer_state(weight, name, sc::DType::f32));
  for (sc::ShardedParam& p : out) p.shard = device.allocate_device(p.dtype, p.shard_shape());
  return out;
}

sc::StateDict state_of(const std::vector<sc::ShardedParam>& tensors, std::int64_t step) {
  sc::StateDict state;
  for (const sc::ShardedParam& p : tensors) state.add(p);
  state.add_common("optimizer.step", step);
  return state;
}

// A stand-in for forward and backward: they read the weights (here: copy them to the host), never
// change them, so they may run while a save reads the same weights.
void forward_backward(sc::CopyEngine& device, const std::vector<sc::ShardedParam>& tensors) {
  const sc::ShardedParam& weight = tensors.front();
  sc::HostBuffer activations = sc::HostBuffer::uninitialized(weight.dtype, weight.shard_shape());
  device.copy_to_host(weight.shard.view(), activations.mut_view());
  device.wait(device.fence());
}

// A stand-in for the optimizer step: every element of every tensor becomes `step`.
void optimizer_step(sc::CopyEngine& device, std::vector<sc::ShardedParam>& tensors, std::int64_t step) {
  for (sc::ShardedParam& p : tensors) {
    sc::HostBuffer values = sc::HostBuffer::zeros(p.dtype, p.shard_shape());
    if (p.dtype == sc::DType::f32)
      for (float& x : values.mut_view().as<float>()) x = static_cast<float>(step);
    else
      for (sc::bf16& x : values.mut_view().as<sc::bf16>()) x = sc::to_bf16(static_cast<float>(step));
    device.copy_to_device(values.view(), p.shard.mut_view());
    device.wait(device.fence());
  }
}

void train(const char* path) {
  const std::int64_t tp = 2, gtp = 2;
  sc::run_ranks(tp * gtp, [&](sc::ProcessGroup& group) {
    const auto device = std::make_shared<sc::EmulatedDevice>();
    auto tensors = model(*device, in_proj(tp, gtp, 16, {.tp_rank = group.rank() / gtp, .gtp_rank = group.rank() % gtp}));
    // The saver shares the ownership of the engine. Its host budget (16 KiB here, 128 MiB by
    // default) is less than a rank's 26 to 42 KiB, which stream through it.
    sc::Saver saver(group, {.engine = device, .staging_buffer_bytes = 8 << 10});
    std::optional<sc::AsyncSave> pending;
    for (std::int64_t step = 1; step <= 30; ++step) {
      forward_backward(*device, tensors);  // overlaps the save in flight
      if (pending) pending->wait_staged();  // the save has read the weights: the step may change them
      optimizer_step(*device, tensors, step);
      if (step % 10 != 0) continue;
      if (pending) pending->wait();  // the previous checkpoint is committed (or this throws)
      // Returns at once; the weights must not change until wait_staged() returns.
      pending = saver.save_async(state_of(tensors, step), path);
    }
    pending->wait();
  });
}

// The restart: TP 1 x GTP 2 ranks allocate their own device tensors and load into them.
std::int64_t restart(const char* path) {
  std::atomic<std::int64_t> wrong{0}, step{0};
  sc::run_ranks(2, [&](sc::ProcessGroup& group) {
    const auto device = std::make_shared<sc::EmulatedDevice>();
    const auto tensors = model(*device, in_proj(1, 2, 8, {.tp_rank = 0, .gtp_rank = group.rank()}));
    sc::StateDict state;
    for (const sc::ShardedParam& p : tensors) state.add(p);
    // Device rows go through pinned memory; the pool shares the ownership of its engine.
    const auto pool = std::make_shared<sc::StagingPool>(device, std::size_t{1} << 20);
    const sc::Values values = sc::load_into(path, state, group, {.staging = pool});
    if (group.rank() == 0) step = std::get<std::int64_t>(values.at("optimizer.step"));
    // Check the fp32 master weights: every real element is 30, every pad element 0.
    const sc::ShardedParam& master = tensors.back();
    sc::HostBuffer back = sc::HostBuffer::uninitialized(master.dtype, master.shard_shape());
    device->copy_to_host(master.shard.view(), back.mut_view());
    device->wait(device->fence());
    const std::int64_t real = sc::plan_rank(master.spec, master.gtp, master.align, master.coord).real_rows;
    const auto v = back.view().as<float>();
    for (std::size_t i = 0; i < v.size(); ++i)
      wrong += v[i] != (static_cast<std::int64_t>(i) < real * master.spec.row_elems() ? 30.0f : 0.0f);
  });
  return step == 30 ? wrong.load() : wrong + 1;
}

int main() {
  try {
    train("training.h5");
    const std::int64_t wrong = restart("training.h5");
    std::printf("saved every 10 steps in the background; restarted at TP 1 x GTP 2: %s\n",
                wrong == 0 ? "every value as saved at step 30" : "MISMATCH");
    return wrong == 0 ? 0 : 1;
  } catch (const sc::Error& e) {
    std::fprintf(stderr, "%s: %s\n", std::string(sc::errc_name(e.code())).c_str(), e.what());
    return 2;
  }
}
