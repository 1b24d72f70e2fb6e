module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;
import :raw;
import :records;

namespace shardckpt {

namespace {

namespace fs = std::filesystem;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;

// A dataset of a plain file, and where its row-major bytes are.
struct PlainDataset {
  std::string key;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t address;
};

// The tensors at the root of a plain HDF5 file; anything adopt cannot point at is an error.
std::vector<PlainDataset> plain_datasets(io::File& f) {
  const fs::path& plain = f.path();
  const std::uint64_t size = f.size();
  hdf5::Channel channel(f);
  Hid h5 = hdf5::open_file(channel, false, Errc::not_a_checkpoint);
  std::vector<PlainDataset> out;
  for (const std::string& name : hdf5::link_names(h5.get(), {plain, "", "list the datasets"})) {
    const Where w{plain, name, "adopt the dataset"};
    const auto cannot = [&](std::string_view why) {
      throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": ", name, " ", why));
    };
    if (name == meta_group) cannot("exists: the file is a shardckpt checkpoint already");
    if (!hdf5::hard_link_exists(h5.get(), name.c_str(), w) || hdf5::object_type(h5.get(), name.c_str(), w) != H5O_TYPE_DATASET)
      cannot("is not a dataset");
    Hid set = owned(H5Dopen2(h5.get(), name.c_str(), H5P_DEFAULT), H5Dclose, w, Errc::not_a_checkpoint);
    Hid type = owned(H5Dget_type(set.get()), H5Tclose, w, Errc::not_a_checkpoint);
    const std::optional<DType> dtype = hdf5::dtype_of(type.get());
    std::vector<std::int64_t> shape = hdf5::shape_of(set.get(), w, Errc::not_a_checkpoint);
    if (!dtype || !hdf5::stored_exactly(type.get(), *dtype) || shape.empty())
      cannot("is not a tensor of a type shardckpt stores as it is (a little-endian number, at least one dimension)");
    Hid dcpl = owned(H5Dget_create_plist(set.get()), H5Pclose, w, Errc::not_a_checkpoint);
    const haddr_t address = H5Dget_offset(set.get());
    H5Eclear2(H5E_DEFAULT);
    const auto bytes = static_cast<std::uint64_t>(element_count(shape)) * dtype_size(*dtype);
    if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS || H5Pget_external_count(dcpl.get()) != 0 ||
        address == HADDR_UNDEF || address > size || bytes > size - address)
      cannot("is not stored contiguously in the file (rewrite it with h5repack -l CONTI)");
    out.push_back({name, *dtype, std::move(shape), address});
  }
  if (out.empty()) throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": it holds no dataset"));
  return out;
}

// The XXH3-64 of every row of every dataset, read from the plain file once, in dataset order.
std::vector<std::uint64_t> row_hashes(const io::File& f, const std::vector<PlainDataset>& sets) {
  std::vector<std::uint64_t> out;
  std::vector<std::byte> batch;
  for (const PlainDataset& d : sets) {
    const std::int64_t row = element_count(std::span(d.shape).subspan(1)) * element_bytes(d.dtype);
    const std::int64_t step = batch_rows(row);
    for (std::int64_t r0 = 0; r0 < d.shape[0]; r0 += step) {
      const std::int64_t n = std::min(step, d.shape[0] - r0);
      batch.resize(static_cast<std::size_t>(n * row));
      f.pread_all(batch.data(), batch.size(), d.address + static_cast<std::uint64_t>(r0 * row));
      for (std::int64_t r = 0; r < n; ++r) out.push_back(row_hash(batch.data() + r * row, static_cast<std::size_t>(row)));
    }
  }
  return out;
}

// The records must describe the plain file's datasets (keys, shapes, one dtype per parameter).
void check_adopted_records(const std::vector<ParamRecord>& records, const std::vector<PlainDataset>& sets) {
  std::map<std::string, Dataset, std::less<>> by_key;
  for (const PlainDataset& d : sets) by_key.emplace(d.key, Dataset{d.key, d.dtype, d.shape});
  check_records(
      records,
      [&](const std::string& key) -> const Dataset& {
        const auto it = by_key.find(key);
        require(it != by_key.end(), Errc::missing_key, "the file has no dataset ", key);
        return it->second;
      },
      [](const ParamRecord& r, std::string_view why) {
        throw Error(Errc::invalid_argument,
                    cat("the parameter records do not describe its datasets: the record of ", r.key, " ", why));
      });
}

}  // namespace

AdoptReport adopt(const fs::path& plain, const fs::path& out, const std::vector<ParamRecord>& records,
                  const Values& common) {
  try {
    io::Destination dest = io::Destination::of(out);
    const fs::path source = io::follow_links(plain);
    const io::Directory dir = io::Directory::open(source.parent_path());
    io::File f = dir.open_regular(source.filename().string(), Errc::not_a_checkpoint);
    const io::FileStatus here = dir.status(), there = dest.dir.status();
    require(here.identity == there.identity, Errc::invalid_argument, out.string(),
            " must be in the same directory as ", plain.string(), " (the checkpoint finds the bytes beside it)");
    const std::optional<io::FileStatus> replaced = dest.dir.status(dest.name);
    require(!replaced || replaced->identity != f.identity(), Errc::invalid_argument, out.string(), " is ",
            plain.string(), " itself: the checkpoint would replace the file whose bytes it points at");
    const std::vector<PlainDataset> sets = plain_datasets(f);
    check_adopted_records(records, sets);
    std::vector<Dataset> specs;
    AdoptReport report;
    std::int64_t checksum_rows = 0;
    for (const PlainDataset& d : sets) {
      const Box whole = whole_box(d.shape);
      specs.push_back({d.key, d.dtype, d.shape, std::nullopt, {}, {}, ExternalData{source.filename().string(), d.address}});
      if (!whole.empty()) specs.back().slabs.push_back({whole, checksum_rows});
      checksum_rows += checksum_rows_of(whole);
      report.bytes += element_count(d.shape) * element_bytes(d.dtype);
    }
    const std::vector<std::uint64_t> hashes = row_hashes(f, sets);
    io::TemporaryFile temp = io::TemporaryFile::create(std::move(dest));
    const Skeleton skeleton =
        create_skeleton(temp.file(), specs, {CheckpointKind::global, records, common, io::random_id()}, checksum_rows);
    if (!hashes.empty())
      temp.file().pwrite_all(hashes.data(), hashes.size() * sizeof(std::uint64_t), skeleton.checksums_address);
    mark_complete(temp.file(), skeleton.data);
    temp.commit();
    report.tensors = static_cast<std::int64_t>(sets.size());
    report.params = static_cast<std::int64_t>(records.size());
    return report;
  } catch (Error& e) {
    throw std::move(e.add_context(cat("adopting ", plain.string())));
  }
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
  for (const Dataset& d : reader.datasets())
    total = checked_add(total, checked_mul(element_count(d.shape), element_bytes(d.dtype), "dataset bytes"),
                        "checkpoint bytes");
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
