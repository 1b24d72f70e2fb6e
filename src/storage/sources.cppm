// shardckpt.storage:sources (implementation partition): what adopt reads, as values. An adopt input
// is a plain HDF5 file (as h5py writes it) or a safetensors file (as Hugging Face's safetensors
// writes it); either is a list of tensors, each with its dtype, shape and the file offset where its
// row-major, little-endian bytes begin. Both readers treat the file as hostile: every offset and
// size is checked against the file before it is returned, and nothing here reads tensor bytes.
module;
#include <cstdint>
#include <string>
#include <vector>
module shardckpt.storage:sources;
import shardckpt.core;
import :file;

namespace shardckpt {

// A tensor of an adopt input: `bytes` (its elements times their size) lie from `address` on, inside
// the file.
struct SourceTensor {
  std::string key;
  DType dtype = DType::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t address = 0;
};

enum class SourceFormat : std::uint8_t { hdf5, safetensors };

// HDF5 when the file carries HDF5's signature where HDF5 looks for it (byte 0, 512, 1024, ...),
// else safetensors.
SourceFormat source_format(const io::File& f);

// The tensors at the root of a plain HDF5 file, in name order: contiguous, unfiltered datasets of
// a little-endian type the library stores as it is. Anything else is Errc::not_a_checkpoint
// naming the file and the object (src/storage/adopt.cpp).
std::vector<SourceTensor> hdf5_tensors(io::File& f);

// The tensors of a safetensors file (8-byte little-endian header length N, N bytes of JSON, then
// the data), in name order. The header is checked field by field: its length inside the file and
// at most 100 MB, strict JSON without duplicate keys, every tensor's dtype known, its shape's bytes
// equal to its data_offsets' length, its bytes inside the data and shared with no other tensor.
// Any violation is Errc::not_a_checkpoint naming the file and the tensor (src/storage/safetensors.cpp).
std::vector<SourceTensor> safetensors_tensors(const io::File& f);

}  // namespace shardckpt
