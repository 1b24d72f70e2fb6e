// shardckpt.demo: the demo model of the command-line tool, the benchmark and the end-to-end
// tests. GDP layers decoder.layers.0..N-1 and Mamba layers N..N+M-1, each with a fused in_proj and
// conv1d, a row-parallel out_proj (TP on dim 1) and a replicated norm weight; common values and a
// per-rank non-persistent value; optionally Adam's state. Element i (row-major, flat, in its dataset) of every tensor is
// (fnv1a32(key) + i) mod 2^24, exact in f32 and rounded to nearest even in bf16, so any rank at any
// layout can build or check its own shard without seeing anyone else's. Not part of the library:
// nothing the library builds imports it, and it holds no save or load logic of its own.
module;
#include <memory>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
export module shardckpt.demo;
import shardckpt;

export namespace shardckpt::demo {

struct ModelConfig {
  int gdp_layers = 2;
  int mamba_layers = 1;
  SsmDims dims{.heads = 8, .head_dim = 16, .groups = 4, .state = 16, .householder = 2};
  std::int64_t cols = 256;  // hidden size: the trailing dim of in_proj, the rows of out_proj
  std::int64_t conv_kernel = 4;
  DType dtype = DType::bf16;
};

// DP x TP x GTP ranks; global rank = (dp * tp + tp_rank) * gtp + gtp_rank.
struct Layout {
  int tp = 1;
  int gtp = 1;
  std::int64_t align = 0;
  int dp = 1;
  int ranks() const noexcept { return dp * tp * gtp; }
};

struct RankCoord {
  int dp = 0;
  int tp = 0;
  int gtp = 0;
};
// Throws Errc::invalid_argument when `rank` is outside the layout.
RankCoord coord_of(const Layout& layout, int rank);
std::string layout_text(const Layout& layout);
nlohmann::json layout_json(const Layout& layout);

// The common value `model_config` the demo saves, and the model a checkpoint's common values
// describe when the demo wrote it (its elements then follow the pattern).
std::string config_json(const ModelConfig& config);
std::optional<ModelConfig> config_of(const CheckpointContents& contents);

std::uint32_t fnv1a32(std::string_view bytes) noexcept;
// The pattern value of element `index` of the dataset `key`, as f32.
float pattern(std::string_view key, std::uint64_t index) noexcept;

// What a rank holds besides its parameters. With `adam`, every parameter has the companions
// exp_avg, exp_avg_sq and fp32_param (f32, the parameter's layout, keys optimizer.state.<name>.<key>)
// and the step and hyperparameters are common values. With `distributed` as well, each DP rank
// holds only its flat range of each companion (Megatron's distributed optimizer).
struct Training {
  bool adam = false;
  bool distributed = false;
};
inline constexpr std::string_view adam_states[] = {"exp_avg", "exp_avg_sq", "fp32_param"};

// Every parameter of the model at TP degree `tp`.
std::vector<ParamSpec> params(const ModelConfig& config, std::int64_t tp);
// The bytes of every tensor of the model (and its optimizer state), as a checkpoint holds them.
std::int64_t model_bytes(const ModelConfig& config, const Training& training = {});

// Where a rank's shards live: host, pinned host or device memory (for pinned and device memory,
// the engine that allocates and moves it; pinned without one is locked host memory).
struct ShardMemory {
  MemoryKind memory = MemoryKind::host;
  std::shared_ptr<CopyEngine> engine = nullptr;
};

// One rank's model: a state dict that owns its shards (pattern in real rows, zeros in pad rows).
struct RankModel {
  StateDict state;
  std::int64_t shard_bytes = 0;
  std::int64_t pad_rows = 0;  // pad rows this rank holds (never saved)
};
RankModel build_rank(const ModelConfig& config, const Layout& layout, int rank, const Training& training = {},
                     ShardMemory placement = {});
// The load request of one rank: the same entries, without data.
StateDict request(const ModelConfig& config, const Layout& layout, int rank, const Training& training = {});
// A request's entries with the tensors of a load as their data.
StateDict attach(const StateDict& request, const LoadedState& loaded);
// A request's entries with shards to load into, in `placement`'s memory, every byte 0xff (so that a
// load must write every one): what a trainer's model is to load_into.
StateDict with_destinations(const StateDict& request, ShardMemory placement = {});

struct Verification {
  std::int64_t values = 0;    // elements compared
  std::int64_t pad_rows = 0;  // pad rows checked to be zero
  std::int64_t mismatches = 0;
  std::string first_mismatch;  // key, row and values of the first one
};
// Checks every shard of `filled` (this rank's state dict after a load; device shards are copied to
// the host through `engine`, one at a time) against the pattern (real rows, unless `pattern` is
// false: a checkpoint the demo did not write) and zero (pad rows).
Verification verify_tensors(const StateDict& filled, int rank, CopyEngine* engine = nullptr, bool pattern = true);
// The same, and the values of a demo load request (common values saved with `training`, and local).
Verification verify(const ModelConfig& config, const Training& training, int rank, const StateDict& filled,
                    const Values& values, CopyEngine* engine = nullptr);
Verification verify(const ModelConfig& config, const Training& training, int rank, const StateDict& request,
                    const LoadedState& loaded);

// The peak resident memory of this process so far (VmHWM), in bytes.
std::int64_t peak_rss_bytes();

// The old save the library replaces, kept as the benchmark's baseline: every GTP rank all-gathers
// its whole TP-local weight, splits it into blocks and the first GTP rank writes them. Runs all
// ranks of `models` (one per rank of `layout`, DP 1) in this process; returns the peak bytes that
// the gathers kept alive on one rank.
std::int64_t gather_save(const ModelConfig& config, const Layout& layout, const std::vector<RankModel>& models,
                         const std::filesystem::path& path);

}  // namespace shardckpt::demo
