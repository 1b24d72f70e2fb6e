// The fuzzed operations (see fuzz_one.hpp): everything a tool does with a file it did not write.
#include "fuzz_one.hpp"

#include <hdf5.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
import shardckpt;

namespace testing_support {
namespace {

using namespace shardckpt;

// Reads and checks are bounded, so that a file claiming huge tensors costs no more than a small one.
constexpr std::int64_t max_bytes = std::int64_t{4} << 20;

std::int64_t bytes_of(const Dataset& d) {
  return checked_mul(element_count(d.shape), element_bytes(d.dtype), "dataset bytes");
}

void exercise(const std::string& path) {
  // Sealed files only: HDF5 1.10 itself can crash on damaged metadata it parses, which is what the
  // seal keeps from it (docs/format.md). The fuzzer changes data and metadata bytes alike.
  const CheckpointReader reader(path, {.require_seal = true});
  (void)reader.skipped();
  std::int64_t total = 0;
  for (const Dataset& d : reader.datasets()) {
    const std::int64_t bytes = bytes_of(d);
    total = checked_add(total, bytes, "checkpoint bytes");
    if (bytes > max_bytes || d.shape[0] == 0) continue;
    // The first rows of every tensor, by both read paths, checked and not.
    const Box whole = whole_box(d.shape);
    const Box head{{0, std::min<std::int64_t>(whole.rows.end, 3)}, whole.cols};
    std::vector<std::byte> buffer(static_cast<std::size_t>(box_elements(head)) * dtype_size(d.dtype));
    const MutTensorView view = MutTensorView::unchecked(buffer.data(), d.dtype, {head.rows.size(), head.cols.size()});
    for (IoMethod m : {IoMethod::raw, IoMethod::hyperslab}) {
      try {
        reader.read(d, head, view, {.method = m});
      } catch (const Error&) {
      }
      try {
        reader.read(d, head, view, {.method = m, .verify = false});
      } catch (const Error&) {
      }
    }
  }
  (void)reader.params();
  if (total > max_bytes) return;
  (void)verify_checkpoint(reader);
  // What `shardckpt load` does: every tensor at another layout, from the file's own records.
  for (std::int64_t g = 0; g < 2; ++g) {
    StateDict request = request_all(reader, {.tp = 1, .gtp = 2, .align = 4, .coord = {0, g}});
    (void)load(reader, request);
  }
}

}  // namespace

void fuzz_one_input(const std::uint8_t* data, std::size_t size) {
  // The image as a file in memory, opened by path like any checkpoint.
  const int fd = ::memfd_create("checkpoint", MFD_CLOEXEC);
  if (fd < 0) return;
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  try {
    exercise("/proc/self/fd/" + std::to_string(fd));
  } catch (const Error&) {  // refusing a file is the expected outcome, whatever the code
  }
  ::close(fd);
  // Whatever happened, every HDF5 object the library opened is closed again (a crash here keeps the
  // input: an object left open is a leak that only shows, if at all, when the process exits).
  if (const ssize_t open = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL); open != 0) {
    std::fprintf(stderr, "fuzz_one_input: %zd HDF5 objects left open\n", open);
    std::abort();
  }
}

}  // namespace testing_support
