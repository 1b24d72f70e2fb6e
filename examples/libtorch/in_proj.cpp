// A GatedDeltaProduct layer in libtorch whose fused in_proj [z | V0 V1 | K0 K1 | Q | b0 b1 | a] is
// GTP-sharded as a training job holds it: TP 1 x GTP 2 ranks at alignment 16, each rank's padded
// shard a tensor of its own. Two thread ranks save their shards through the C API (nothing gathered,
// pad rows never written); three ranks load them back at GTP 3, alignment 8, into fresh shards; the
// weight they hold together is bit-equal to the model's, their pad rows are zero, and a model built
// from them computes the same output. Usage: in_proj CHECKPOINT (docs/c-api.md)
#include <shardckpt/shardckpt.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// The layer's sizes; with TP 1 its in_proj has 32 + 2*32 + 2*16 + 16 + 2*4 + 4 = 156 rows.
constexpr std::int64_t heads = 4, head_dim = 8, groups = 2, state = 8, householder = 2, hidden = 64;
const char* const key = "decoder.layers.0.mixer.in_proj.weight";

struct GdpLayerImpl : torch::nn::Module {
  explicit GdpLayerImpl(std::int64_t rows)
      : in_proj(register_module("in_proj", torch::nn::Linear(torch::nn::LinearOptions(hidden, rows).bias(false)))) {}
  torch::Tensor forward(const torch::Tensor& x) { return in_proj(x); }
  torch::nn::Linear in_proj;
};
TORCH_MODULE(GdpLayer);

// The in_proj's blocks in row order (docs/python.md, "The fused-layout rule"): names and TP-local rows.
struct Sections {
  std::vector<std::string> names;
  std::vector<shardckpt_section> list;
  std::int64_t rows = 0;
};
Sections gdp_in_proj_sections() {
  Sections s;
  const std::int64_t d_inner = heads * head_dim, group_state = groups * state;
  auto add = [&](std::string name, std::int64_t rows) { s.names.push_back(std::move(name)), s.list.push_back({nullptr, rows}); };
  add("z", d_inner);
  for (std::int64_t h = 0; h < householder; ++h) add("V" + std::to_string(h), d_inner);
  for (std::int64_t h = 0; h < householder; ++h) add("K" + std::to_string(h), group_state);
  add("Q", group_state);
  for (std::int64_t h = 0; h < householder; ++h) add("b" + std::to_string(h), heads);
  add("a", heads);
  for (std::size_t i = 0; i < s.list.size(); ++i) s.list[i].name = s.names[i].c_str(), s.rows += s.list[i].rows;
  return s;
}

void check(int rc, const char* what) {
  if (rc != SHARDCKPT_OK)
    throw std::runtime_error(std::string(what) + ": " + shardckpt_errc_name(rc) + ": " + shardckpt_last_error());
}

shardckpt_dtype dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kBFloat16: return SHARDCKPT_BF16;
    case torch::kHalf: return SHARDCKPT_F16;
    case torch::kFloat: return SHARDCKPT_F32;
    case torch::kDouble: return SHARDCKPT_F64;
    default: throw std::runtime_error("a dtype this example does not map");
  }
}

// The in_proj as GTP rank `rank` of `gtp` holds it, with `shard` (contiguous) as its padded shard.
shardckpt_param in_proj_param(const Sections& s, std::int64_t gtp, std::int64_t rank, std::int64_t align,
                              const torch::Tensor& shard) {
  static const std::int64_t trailing[] = {hidden};
  static const shardckpt_divisor divisors[] = {{"heads", heads}, {"groups", groups}};  // TP must divide them
  shardckpt_param p{};
  p.key = key;
  p.sections = s.list.data();
  p.section_count = s.list.size();
  p.trailing = trailing;
  p.trailing_count = 1;
  p.divisors = divisors;
  p.divisor_count = 2;
  p.tp_axis = SHARDCKPT_TP_ROWS;
  p.tp = 1;
  p.gtp = gtp;
  p.gtp_rank = rank;
  p.align = align;
  if (shard.defined()) {
    p.dtype = dtype_of(shard);
    p.shard = shard.data_ptr();
    p.shard_bytes = shard.nbytes();
  }
  return p;
}

std::int64_t shard_rows(const Sections& s, std::int64_t gtp, std::int64_t align) {
  std::int64_t rows = 0;
  const shardckpt_param p = in_proj_param(s, gtp, 0, align, {});
  check(shardckpt_shard_rows(&p, &rows, nullptr), "shard rows");
  return rows;
}

// Each GTP rank's padded shard of `weight`: its rows of the weight, then zero pad rows.
std::vector<torch::Tensor> shard_weight(const torch::Tensor& weight, std::int64_t gtp, std::int64_t rows_per_shard) {
  const torch::Tensor padded = torch::zeros({gtp * rows_per_shard, hidden}, weight.options());
  padded.narrow(0, 0, weight.size(0)).copy_(weight);
  std::vector<torch::Tensor> shards;
  for (std::int64_t g = 0; g < gtp; ++g) shards.push_back(padded.narrow(0, g * rows_per_shard, rows_per_shard).clone());
  return shards;
}

// One state dict per rank, each holding that rank's shard.
std::vector<shardckpt_state*> states_of(const Sections& s, const std::vector<torch::Tensor>& shards,
                                        std::int64_t align) {
  std::vector<shardckpt_state*> states;
  for (std::size_t g = 0; g < shards.size(); ++g) {
    states.push_back(shardckpt_state_new());
    const shardckpt_param p = in_proj_param(s, static_cast<std::int64_t>(shards.size()), static_cast<std::int64_t>(g),
                                            align, shards[g]);
    check(shardckpt_state_add_param(states.back(), &p), "add a shard");
  }
  return states;
}

void free_states(std::vector<shardckpt_state*>& states) {
  for (shardckpt_state* s : states) shardckpt_state_free(s);
  states.clear();
}

void save(const char* path, const Sections& s, const torch::Tensor& weight) {
  const std::int64_t gtp = 2, align = 16;
  const std::vector<torch::Tensor> shards = shard_weight(weight, gtp, shard_rows(s, gtp, align));
  std::vector<shardckpt_state*> states = states_of(s, shards, align);
  check(shardckpt_state_add_int(states[0], "iteration", 1000), "add a value");
  check(shardckpt_state_add_double(states[0], "lr", 3e-4), "add a value");
  const int rc = shardckpt_save_ranks(states.data(), static_cast<int>(states.size()), path);
  free_states(states);
  check(rc, "save");
}

// The shards of GTP 3 ranks at alignment 8, loaded from `path` (filled with 7 first: the load
// overwrites every row, pad rows with zeros).
std::vector<torch::Tensor> load(const char* path, const Sections& s, std::int64_t* iteration) {
  const std::int64_t gtp = 3, align = 8, rows = shard_rows(s, gtp, align);
  std::vector<torch::Tensor> shards;
  for (std::int64_t g = 0; g < gtp; ++g) shards.push_back(torch::full({rows, hidden}, 7.0, torch::kBFloat16));
  std::vector<shardckpt_state*> states = states_of(s, shards, align);
  shardckpt_values* values = nullptr;
  const int rc = shardckpt_load_into_ranks(path, states.data(), static_cast<int>(gtp), &values);
  free_states(states);
  check(rc, "load");
  check(shardckpt_values_int(values, "iteration", iteration), "iteration");
  shardckpt_values_free(values);
  return shards;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CHECKPOINT\n", argv[0]);
    return 2;
  }
  try {
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    const Sections s = gdp_in_proj_sections();
    GdpLayer model(s.rows);
    model->to(torch::kBFloat16);
    const torch::Tensor weight = model->in_proj->weight;
    save(argv[1], s, weight);

    std::int64_t iteration = 0;
    const torch::Tensor loaded = torch::cat(load(argv[1], s, &iteration));
    const torch::Tensor real = loaded.narrow(0, 0, s.rows), pad = loaded.narrow(0, s.rows, loaded.size(0) - s.rows);
    const bool bits_equal = torch::equal(real.view(torch::kShort), weight.view(torch::kShort));
    const bool pad_zero = torch::equal(pad.view(torch::kShort), torch::zeros_like(pad).view(torch::kShort));
    GdpLayer restored(s.rows);
    restored->to(torch::kBFloat16);
    restored->in_proj->weight.copy_(real);
    const torch::Tensor x = torch::randn({3, hidden}).to(torch::kBFloat16);
    const bool same_output = torch::equal(model->forward(x), restored->forward(x));
    std::printf("in_proj %lld x %lld bf16 saved at TP 1 x GTP 2 (alignment 16), loaded at GTP 3 (alignment 8): "
                "weight %s, %lld pad rows %s, output %s, iteration %lld\n",
                static_cast<long long>(s.rows), static_cast<long long>(hidden), bits_equal ? "bit-equal" : "DIFFERS",
                static_cast<long long>(pad.size(0)), pad_zero ? "zero" : "NOT ZERO", same_output ? "equal" : "DIFFERS",
                static_cast<long long>(iteration));
    return bits_equal && pad_zero && same_output && iteration == 1000 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "in_proj: %s\n", e.what());
    return 1;
  }
}
