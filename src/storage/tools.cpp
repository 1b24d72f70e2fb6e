// verify_checkpoint and hdf5_thread_safe (modules/storage/tools.cppm); adopt is in adopt.cpp.
module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :raw;

namespace shardckpt {

namespace {
// A dataset's bytes, checked against overflow (a header may claim any shape).
std::int64_t dataset_bytes(const Dataset& d) {
  return checked_mul(element_count(d.shape), element_bytes(d.dtype), "dataset bytes");
}
}  // namespace

InspectReport inspect_checkpoint(const CheckpointReader& reader) {
  InspectReport out;
  const CheckpointContents& c = reader.contents();
  out.file = reader.path();
  out.format_version = reader.version();
  out.kind = c.kind;
  out.checkpoint_id = c.id;
  out.checksummed = reader.checksummed();
  out.params = reader.params();
  for (const Dataset& d : reader.datasets()) {
    const std::int64_t bytes = dataset_bytes(d);
    out.bytes = checked_add(out.bytes, bytes, "checkpoint bytes");
    out.tensors.push_back({d.key, d.dtype, d.shape, bytes});
  }
  out.common = c.common;
  out.skipped = reader.skipped();
  return out;
}

bool hdf5_thread_safe() noexcept {
  hbool_t safe = false;
  return H5is_library_threadsafe(&safe) >= 0 && safe;
}

VerifyReport verify_checkpoint(const CheckpointReader& reader,
                               const std::function<void(std::int64_t, std::int64_t)>& progress) {
  VerifyReport report;
  report.checksummed = reader.checksummed();
  (void)reader.params();
  std::int64_t total = 0, done = 0;
  for (const Dataset& d : reader.datasets()) total = checked_add(total, dataset_bytes(d), "checkpoint bytes");
  report.datasets = static_cast<std::int64_t>(reader.datasets().size());
  report.bytes = total;
  if (!report.checksummed) return report;
  std::vector<std::byte> buffer;
  for (const Dataset& d : reader.datasets()) {
    const std::int64_t es = element_bytes(d.dtype);
    for (const Slab& s : reader.slabs(d)) {
      const std::int64_t row_bytes = s.box.cols.size() * es, step = batch_rows(row_bytes);
      for (std::int64_t r0 = s.box.rows.begin; r0 < s.box.rows.end; r0 += step) {
        const Box batch{{r0, std::min(r0 + step, s.box.rows.end)}, s.box.cols};
        buffer.resize(static_cast<std::size_t>(box_elements(batch) * es));
        const MutTensorView view = MutTensorView::unchecked(buffer.data(), d.dtype, {batch.rows.size(), batch.cols.size()});
        try {
          reader.read(d, batch, view);
          report.checksum_rows += batch.rows.size();
        } catch (const Error& e) {
          if (e.code() != Errc::corrupt) throw;
          // Find every bad row of the batch, not only the first.
          for (std::int64_t r = batch.rows.begin; r < batch.rows.end; ++r) {
            const Box row{{r, r + 1}, s.box.cols};
            try {
              reader.read(d, row, view.slice_rows(0, 1));
            } catch (const Error& bad) {
              if (bad.code() != Errc::corrupt) throw;
              if (report.mismatches++ < 16) report.problems.emplace_back(bad.what());
            }
            ++report.checksum_rows;
          }
        }
        done += box_elements(batch) * es;
        if (progress) progress(done, total);
      }
    }
  }
  return report;
}

}  // namespace shardckpt
