// shardckpt.storage:tools: what works on whole checkpoint files beside saving and loading: adopting
// a plain HDF5 or safetensors file (its bytes stay where they are), checking every byte of a
// checkpoint against its checksums, and parameter records as JSON text. Adopting never changes or
// replaces its input, and verifying never trusts a byte it has not checked.
module;
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
export module shardckpt.storage:tools;
import shardckpt.core;
import shardckpt.layout;
import :format;
import :reader;

export namespace shardckpt {

// What verify_checkpoint found.
struct VerifyReport {
  bool checksummed = true;
  std::int64_t datasets = 0;
  std::int64_t bytes = 0;
  std::int64_t checksum_rows = 0;  // rows checked
  std::int64_t mismatches = 0;  // rows whose bytes differ from their checksum
  std::vector<std::string> problems;  // the first few, naming key and rows
};
// Makes `plain`, a plain HDF5 file (datasets at the root, contiguous and unfiltered, as h5py writes
// them; no shardckpt metadata) or a safetensors file (as Hugging Face's safetensors writes it; told
// apart by their first bytes), loadable as a checkpoint without rewriting its data: writes the
// checkpoint `out`, in the same directory, whose datasets keep their bytes in `plain` (HDF5 external
// storage) and which carries the parameter records, `common`, the slab table and the checksum of
// every row (read from `plain` once). Each tensor of `plain` is one dataset under its own name,
// except a fused tensor: a tensor named by the key of a record of named blocks holds those blocks'
// rows one after another (as a TP 1 run holds it), and becomes one dataset per block, each pointing
// at its rows of the tensor. `plain` is not changed. Throws Errc::not_a_checkpoint naming a tensor
// or header field it cannot adopt, Errc::invalid_argument when the records do not match the
// tensors, and Errc::io. `out` may not be `plain` itself (the same file through any link) and may
// not name anything but a regular file; it is written like a save (a temporary file, committed
// atomically).
struct AdoptReport {
  std::int64_t tensors = 0;  // datasets of the checkpoint
  std::int64_t params = 0;   // parameter records
  std::int64_t bytes = 0;    // tensor bytes, all in `plain`
  std::int64_t fused = 0;    // fused tensors of `plain` adopted as their blocks
};
AdoptReport adopt(const std::filesystem::path& plain, const std::filesystem::path& out,
                  const std::vector<ParamRecord>& records, const Values& common);
// Parameter records as JSON text (the `params` attribute of docs/format.md), and back; throws
// Errc::invalid_argument for text that does not hold valid records.
std::string records_json(const std::vector<ParamRecord>& records);
std::vector<ParamRecord> parse_records(std::string_view json_text);

// Whether the HDF5 library this process uses is built thread-safe (H5is_library_threadsafe).
bool hdf5_thread_safe() noexcept;

// What a checkpoint holds, from its reader's checked metadata: one value for every face that shows
// it (`shardckpt inspect`, Python's inspect(), the C API's shardckpt_inspect).
struct InspectReport {
  struct Tensor {
    std::string key;
    DType dtype = DType::f32;
    std::vector<std::int64_t> global_shape;
    std::int64_t bytes = 0;
  };
  std::filesystem::path file;
  int format_version = 0;
  CheckpointKind kind = CheckpointKind::global;
  std::string checkpoint_id;
  bool checksummed = false;
  std::int64_t bytes = 0;  // of every tensor
  std::vector<Tensor> tensors;
  std::vector<ParamRecord> params;
  Values common;
  std::vector<std::pair<std::string, std::string>> skipped;  // datasets that hold no tensor, and why
};
InspectReport inspect_checkpoint(const CheckpointReader& reader);
// The report as JSON text: what `shardckpt inspect --json` prints and shardckpt_inspect returns
// (docs/cli.md).
std::string inspect_json(const InspectReport& report);

// Reads every byte of every tensor of the checkpoint and checks it against its checksum.
// `progress(bytes_done, bytes_total)` is called as it goes.
VerifyReport verify_checkpoint(const CheckpointReader& reader,
                               const std::function<void(std::int64_t, std::int64_t)>& progress = {});

}  // namespace shardckpt
