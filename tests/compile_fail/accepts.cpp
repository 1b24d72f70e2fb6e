// The forms the rejected snippets should have used: each compiles (so that the rejections below
// are the library's doing, not a broken harness).
#include <filesystem>
#include <memory>
#include <vector>
import shardckpt;
import shardckpt.guarded;
using namespace shardckpt;

void shared_ownership(const std::filesystem::path& p) {
  StateDict s;
  {
    SharedBuffer b = SharedBuffer::zeros(DType::f32, {4, 2});
    s.add(ShardedTensor::of("t", b, {4, 2}, {0, 0}));  // the state dict keeps the memory alive
  }
  save(s, p);
}

void explicit_borrow(const std::filesystem::path& p) {
  HostBuffer b = HostBuffer::zeros(DType::f32, {4, 2});
  StateDict s;
  s.add(ShardedTensor::of("t", unchecked_borrow(b.view()), {4, 2}, {0, 0}));  // says it is unchecked
  save(s, p);
}

float views_of_named_owners() {
  HostBuffer b = HostBuffer::zeros(DType::f32, {4});
  const TensorView v = b.view();
  SharedBuffer shared = SharedBuffer::zeros(DType::f32, {4});
  TensorRef ref = shared;  // a non-const owner lends writable memory
  const MutTensorView m = ref.mut_view();
  const TensorRef saved = TensorRef::read_only(static_cast<const SharedBuffer&>(shared));  // a const one: to save
  return v.as<float>()[0] + m.as<float>()[0] + saved.view().as<float>()[0] + to_f32(to_bf16(3.0f)) +
         to_f32(bf16::from_bits(0x3f80));
}

// A load fills a state dict its caller may change; a raw pointer becomes a view only by name; a
// staging pool shares its engine, and options share the pool.
void load_into_a_mutable_state(const std::filesystem::path& p, float* memory) {
  StateDict s;
  s.add(ShardedTensor::of("t", unchecked_borrow(MutTensorView::unchecked(memory, DType::f32, {4, 2})), {4, 2}, {0, 0}));
  (void)load_into(p, s);
  const auto engine = std::make_shared<EmulatedDevice>();
  const auto pool = std::make_shared<StagingPool>(engine, 4096);
  (void)load_into(p, s, LoadOptions{.staging = pool});
}

// An entry's memory is its owner's to change (pointed at other memory, or filled); the entry is not.
void entry_memory_changed(StateDict& s) {
  s.mut_data(0) = SharedBuffer::zeros(s.tensors()[0].dtype, s.tensors()[0].shape);
  (void)s.mut_shard(0).mut_view();
}

// A load's replica group is a group its caller keeps, or none.
void load_with_replicas(const std::filesystem::path& p, StateDict& s, ProcessGroup& g) {
  const std::unique_ptr<ProcessGroup> replicas = g.split(0, g.rank());
  (void)load_into(p, s, g, {}, *replicas);
  (void)load_into(p, s, g, {}, Replicas());
}

HostBuffer counted_copy(const HostBuffer& b) { return b.deep_copy(); }

// A loaded state owns its tensors: a named, non-const one lends them to a state dict that may be
// loaded into; a const one lends them for saving.
void entries_from_a_loaded_state(const std::filesystem::path& p, const StateDict& request, ShardedParam& param) {
  LoadedState loaded = load(p, request);
  param.shard = loaded.tensor("k");
  const LoadedState& frozen = loaded;
  const TensorRef saved = TensorRef::read_only(frozen.tensor("k"));
  (void)saved;
}

// A checkpoint file written step by step, each step consuming the one before.
void checkpoint_in_order(const std::filesystem::path& p) {
  CheckpointWriter w = CheckpointWriter::create(io::Destination::of(p), {}, {}, 0);
  PieceWriter pieces = w.pieces(IoMethod::raw, 0);
  std::move(w).written(pieces.finish()).seal().commit();
}

std::size_t guarded_under_its_handle(const Guarded<std::vector<int>>& g) {
  const auto held = g.lock();  // the lock is held as long as `held`
  std::vector<int>& v = *held;
  return v.size();
}

void checked_once(StateDict& state, ShardedParam p, TensorRef shard) {
  CheckedParam checked = check_param(std::move(p));  // what add() checks, checked here once
  state.add(std::move(checked).with_shard(std::move(shard)));
}
