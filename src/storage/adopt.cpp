// adopt (modules/storage/tools.cppm): a plain HDF5 file or a safetensors file made loadable as a
// checkpoint whose datasets point at the input's bytes (HDF5 external storage). A fused tensor
// becomes its blocks, each one byte range of it; nothing is copied.
module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :file;
import :hdf5;
import :raw;
import :records;
import :sources;

namespace shardckpt {

namespace fs = std::filesystem;

namespace {

// What a link at the root of an adopt input is when it is not a hard link to a dataset, with where it
// points: nothing is followed, nothing opened. A checkpoint without it would lack a tensor the input
// seems to hold (h5py follows soft and external links), so adopt refuses it by name.
std::string not_a_dataset(hid_t file, const std::string& name, const hdf5::Where& w) {
  if (const std::optional<std::string> link = hdf5::link_kind(file, name.c_str(), w)) {
    if (link->starts_with("an external link"))
      return cat("is ", *link, ": adopt follows no link (HDF5 would open that file by name) and takes only datasets "
                 "stored in the file itself (copy the dataset into it, with h5copy say)");
    if (link->starts_with("a soft link"))
      return cat("is ", *link, ": adopt follows no link and takes only the datasets at the root of the file (make it a "
                 "hard link, or copy the dataset to its name)");
    return cat("is ", *link, ": adopt follows no link and takes only the datasets at the root of the file");
  }
  switch (hdf5::object_type(file, name.c_str(), w)) {
    case H5O_TYPE_GROUP:
      return "is a group: adopt takes only the datasets at the root of the file, not those in groups (move them to the root)";
    case H5O_TYPE_NAMED_DATATYPE:
      return "is a named datatype: adopt takes only datasets, and only those at the root of the file";
    default:
      return "is not a dataset: adopt takes only the datasets at the root of the file";
  }
}

}  // namespace

std::vector<SourceTensor> hdf5_tensors(io::File& f) {
  const fs::path& plain = f.path();
  const std::uint64_t size = f.size();
  hdf5::Channel channel(f);
  hdf5::Hid h5 = hdf5::open_file(channel, false, Errc::not_a_checkpoint);
  std::vector<SourceTensor> out;
  for (const std::string& name : hdf5::link_names(h5.get(), {plain, "", "list the datasets"})) {
    const hdf5::Where w{plain, name, "adopt the dataset"};
    const auto cannot = [&](std::string_view why) {
      throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": ", name, " ", why));
    };
    if (name == meta_group) cannot("exists: the file is a shardckpt checkpoint already");
    if (!hdf5::hard_link_exists(h5.get(), name.c_str(), w) || hdf5::object_type(h5.get(), name.c_str(), w) != H5O_TYPE_DATASET)
      cannot(not_a_dataset(h5.get(), name, w));
    hdf5::Hid set = hdf5::owned(H5Dopen2(h5.get(), name.c_str(), H5P_DEFAULT), H5Dclose, w, Errc::not_a_checkpoint);
    hdf5::Hid type = hdf5::owned(H5Dget_type(set.get()), H5Tclose, w, Errc::not_a_checkpoint);
    const std::optional<DType> dtype = hdf5::dtype_of(type.get());
    std::vector<std::int64_t> shape = hdf5::shape_of(set.get(), w, Errc::not_a_checkpoint);
    if (!dtype || !hdf5::stored_exactly(type.get(), *dtype))
      cannot("is not a tensor of a type shardckpt stores as it is (a little-endian number)");
    hdf5::Hid dcpl = hdf5::owned(H5Dget_create_plist(set.get()), H5Pclose, w, Errc::not_a_checkpoint);
    const haddr_t address = H5Dget_offset(set.get());
    H5Eclear2(H5E_DEFAULT);
    const auto bytes = static_cast<std::uint64_t>(element_count(shape)) * dtype_size(*dtype);
    if (H5Pget_external_count(dcpl.get()) != 0)
      cannot("keeps its bytes in other files (HDF5 external storage): adopt takes only bytes stored in the file itself");
    if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS || address == HADDR_UNDEF || address > size || bytes > size - address)
      cannot("is not stored contiguously in the file (rewrite it with h5repack -l CONTI)");
    out.push_back({name, *dtype, std::move(shape), address});
  }
  if (out.empty()) throw Error(Errc::not_a_checkpoint, cat("cannot adopt ", plain.string(), ": it holds no dataset"));
  return out;
}

namespace {

[[noreturn]] void records_disagree(const ParamRecord& r, std::string_view why) {
  throw Error(Errc::invalid_argument,
              cat("the parameter records do not describe its datasets: the record of ", r.key, " ", why));
}

// A record's blocks cut from its fused tensor, as a TP 1 run holds it: the blocks' rows one after
// another in the record's order, so block j is rows [S_j, S_j + rows_j) of the tensor, one byte
// range from address + S_j * (bytes of a row).
void cut_fused(const ParamRecord& r, const SourceTensor& fused, std::vector<SourceTensor>& out) {
  std::vector<std::int64_t> want{0};
  for (const Section& b : r.blocks) want[0] = checked_add(want[0], b.rows, "fused rows");
  want.insert(want.end(), r.trailing.begin(), r.trailing.end());
  if (fused.shape != want)
    records_disagree(r, cat("says the fused tensor has shape ", dims_text(want), " (its blocks one after another) but ",
                            fused.key, " has ", dims_text(fused.shape)));
  const std::int64_t row = element_count(r.trailing) * element_bytes(fused.dtype);
  std::int64_t first = 0;
  for (const Section& b : r.blocks) {
    std::vector<std::int64_t> shape{b.rows};
    shape.insert(shape.end(), r.trailing.begin(), r.trailing.end());
    out.push_back({block_key(r.key, b.name), fused.dtype, std::move(shape),
                   fused.address + static_cast<std::uint64_t>(first) * static_cast<std::uint64_t>(row)});
    first += b.rows;
  }
}

// The checkpoint's datasets, in key order: every tensor of the input as it is, except a tensor
// named by the key of a record of named blocks, which becomes those blocks. `fused` counts those.
std::vector<SourceTensor> adopted_datasets(const std::vector<ParamRecord>& records, std::vector<SourceTensor> tensors,
                                           std::int64_t& fused) {
  std::map<std::string, const SourceTensor*, std::less<>> by_key;
  for (const SourceTensor& t : tensors) {
    require(t.shape.size() <= static_cast<std::size_t>(max_rank), Errc::not_a_checkpoint, "cannot adopt ", t.key,
            " of shape ", dims_text(t.shape), ": a tensor has at most ", max_rank, " dimensions");
    by_key.emplace(t.key, &t);
  }
  std::vector<SourceTensor> out;
  std::set<std::string, std::less<>> cut;
  for (const ParamRecord& r : records) {
    const auto whole = by_key.find(r.key);
    if (whole == by_key.end() || (r.blocks.size() == 1 && r.blocks[0].name.empty())) continue;
    for (const Section& b : r.blocks)
      if (by_key.contains(block_key(r.key, b.name)))
        records_disagree(r, cat("has a fused tensor ", r.key, " and a dataset ", block_key(r.key, b.name),
                                " of one of its blocks: adopt takes one or the other"));
    cut_fused(r, *whole->second, out);
    cut.insert(r.key);
    ++fused;
  }
  for (SourceTensor& t : tensors)
    if (!cut.contains(t.key)) out.push_back(std::move(t));
  std::sort(out.begin(), out.end(), [](const SourceTensor& a, const SourceTensor& b) { return a.key < b.key; });
  for (std::size_t i = 1; i < out.size(); ++i)
    require(out[i - 1].key != out[i].key, Errc::invalid_argument, "the parameter records cut a block ", out[i].key,
            " that the file holds as a tensor of its own");
  return out;
}

// The XXH3-64 of every row of every dataset, read from the input once, in dataset order.
std::vector<std::uint64_t> row_hashes(const io::File& f, const std::vector<SourceTensor>& sets) {
  std::vector<std::uint64_t> out;
  std::vector<std::byte> batch;
  for (const SourceTensor& d : sets) {
    const Box whole = whole_box(d.shape);  // a scalar: one row of one element
    const std::int64_t row = whole.cols.size() * element_bytes(d.dtype);
    const std::int64_t step = batch_rows(row);
    for (std::int64_t r0 = 0; r0 < whole.rows.end; r0 += step) {
      const std::int64_t n = std::min(step, whole.rows.end - r0);
      batch.resize(static_cast<std::size_t>(n * row));
      f.pread_all(batch.data(), batch.size(), d.address + static_cast<std::uint64_t>(r0 * row));
      for (std::int64_t r = 0; r < n; ++r) out.push_back(row_hash(batch.data() + r * row, static_cast<std::size_t>(row)));
    }
  }
  return out;
}

// The records must describe the checkpoint's datasets (keys, shapes, one dtype per parameter).
void check_adopted_records(const std::vector<ParamRecord>& records, const std::vector<SourceTensor>& sets) {
  std::map<std::string, Dataset, std::less<>> by_key;
  for (const SourceTensor& d : sets) by_key.emplace(d.key, Dataset{d.key, d.dtype, d.shape});
  check_records(
      records,
      [&](const std::string& key) -> const Dataset& {
        const auto it = by_key.find(key);
        require(it != by_key.end(), Errc::missing_key, "the file has no dataset ", key);
        return it->second;
      },
      records_disagree);
}

// The input, opened once without following a link (`source` is the given path with its links
// followed) and checked to share the checkpoint's directory without being the checkpoint.
io::File open_input(const fs::path& source, const io::Destination& dest, const fs::path& plain, const fs::path& out) {
  const io::Directory dir = io::Directory::open(source.parent_path());
  io::File f = dir.open_regular(source.filename().string(), Errc::not_a_checkpoint);
  const io::FileStatus here = dir.status(), there = dest.dir.status();
  require(here.identity == there.identity, Errc::invalid_argument, out.string(), " must be in the same directory as ",
          plain.string(), " (the checkpoint finds the bytes beside it)");
  const std::optional<io::FileStatus> replaced = dest.dir.status(dest.name);
  require(!replaced || replaced->identity != f.identity(), Errc::invalid_argument, out.string(), " is ",
          plain.string(), " itself: the checkpoint would replace the file whose bytes it points at");
  return f;
}

std::vector<SourceTensor> tensors_of(io::File& f) {
  return source_format(f) == SourceFormat::safetensors ? safetensors_tensors(f) : hdf5_tensors(f);
}

}  // namespace

AdoptReport adopt(const fs::path& plain, const fs::path& out, const std::vector<ParamRecord>& records,
                  const Values& common) {
  try {
    for (const auto& [key, value] : common) require_key(key, "a common value");
    io::Destination dest = io::Destination::of(out);
    const fs::path source = io::follow_links(plain);
    io::File f = open_input(source, dest, plain, out);
    AdoptReport report;
    const std::vector<SourceTensor> sets = adopted_datasets(records, tensors_of(f), report.fused);
    check_adopted_records(records, sets);
    std::vector<Dataset> specs;
    std::int64_t checksum_rows = 0;
    for (const SourceTensor& d : sets) {
      const Box whole = whole_box(d.shape);
      specs.push_back({d.key, d.dtype, d.shape, std::nullopt, {}, {}, ExternalData{source.filename().string(), d.address}});
      if (!whole.empty()) specs.back().slabs.push_back({whole, checksum_rows});
      checksum_rows += checksum_rows_of(whole);
      report.bytes += element_count(d.shape) * element_bytes(d.dtype);
    }
    const std::vector<std::uint64_t> hashes = row_hashes(f, sets);
    CheckpointWriter checkpoint = CheckpointWriter::create(
        std::move(dest), specs, {CheckpointKind::global, records, common, io::random_id()}, checksum_rows);
    PiecesWritten done = checkpoint.write_checksums(hashes);
    std::move(checkpoint).written(std::move(done)).seal().commit();
    report.tensors = static_cast<std::int64_t>(sets.size());
    report.params = static_cast<std::int64_t>(records.size());
    return report;
  } catch (Error& e) {
    throw std::move(e.add_context(cat("adopting ", plain.string())));
  }
}

}  // namespace shardckpt
