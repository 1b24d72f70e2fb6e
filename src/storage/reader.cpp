module;
#include <hdf5.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>  // Guarded's lock, instantiated here
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.storage;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import :hdf5;
import :raw;
import :records;
import :seal;
import :reader_state;

namespace shardckpt {
namespace {

namespace fs = std::filesystem;
using hdf5::check;
using hdf5::Hid;
using hdf5::owned;
using hdf5::Where;

// Whether every element of a dataset has stored bytes: a contiguous dataset its whole storage, a
// chunked one every chunk of its grid (HDF5 reads a missing chunk, or unallocated contiguous
// storage, as the fill value without an error).
bool fully_stored(hid_t set, hid_t dcpl, const Where& w) {
  const Errc no = Errc::not_a_checkpoint;
  const std::vector<std::int64_t> shape = hdf5::shape_of(set, w, no);
  if (element_count(shape) == 0) return true;
  switch (H5Pget_layout(dcpl)) {
    case H5D_COMPACT:
      return true;
    case H5D_CONTIGUOUS: {
      Hid type = owned(H5Dget_type(set), H5Tclose, w, no);
      const auto want = static_cast<hsize_t>(element_count(shape)) * H5Tget_size(type.get());
      return H5Dget_storage_size(set) >= want;
    }
    case H5D_CHUNKED: {
      std::vector<hsize_t> chunk(shape.size());
      if (H5Pget_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()) != static_cast<int>(chunk.size())) break;
      std::int64_t want = 1;
      for (std::size_t d = 0; d < shape.size(); ++d) {
        if (chunk[d] == 0) return false;
        const auto c = static_cast<std::int64_t>(chunk[d]);
        want = checked_mul(want, (shape[d] + c - 1) / c, "chunks of a dataset", no);
      }
      hsize_t have = 0;
      Hid space = owned(H5Dget_space(set), H5Sclose, w, no);
      if (H5Dget_num_chunks(set, space.get(), &have) < 0) break;
      return static_cast<std::int64_t>(have) == want;
    }
    default:
      break;
  }
  H5Eclear2(H5E_DEFAULT);
  return false;
}


}  // namespace

// The group `name` of `parent`, reached through a hard link only (`shown` names it in messages).
Hid ReaderState::group(hid_t parent, const char* name, std::string_view shown, const Where& w) const {
  if (!hdf5::hard_link_exists(parent, name, w) || hdf5::object_type(parent, name, w) != H5O_TYPE_GROUP)
    refuse(cat("it has no ", shown, " group"));
  return owned(H5Gopen2(parent, name, H5P_DEFAULT), H5Gclose, w, Errc::not_a_checkpoint);
}

void ReaderState::read_metadata() {
  const Where w{path, "", "read the checkpoint metadata"};
  const Errc no = Errc::not_a_checkpoint;
  Hid meta = group(h5.get(), meta_group, "/_shardckpt", w);
  for (const char* name : {"format", "format_version", "kind", "params"})
    if (!hdf5::has_attr(meta.get(), name, w)) refuse(cat("/_shardckpt has no attribute ", name));
  if (hdf5::read_string(meta.get(), "format", w, no) != "shardckpt") refuse("/_shardckpt names another format");
  const std::int64_t v = hdf5::read_int(meta.get(), "format_version", w, no);
  if (v < 1 || v > format_version)
    refuse(cat("format version ", v, " is not one this library reads (1 to ", format_version, ")"));
  version = static_cast<int>(v);
  if (!hdf5::has_attr(meta.get(), "complete", w)) refuse("the save that wrote it did not finish");
  if (hdf5::read_int(meta.get(), "complete", w, no) != 1)
    refuse("attribute complete is not 1: the save that wrote it did not finish");
  const std::string kind = hdf5::read_string(meta.get(), "kind", w, no);
  if (kind != "global" && kind != "local") refuse(cat("attribute kind is '", kind, "', not global or local"));
  contents.kind = kind == "local" ? CheckpointKind::local : CheckpointKind::global;
  try {
    contents.params = params_from_json(hdf5::read_string(meta.get(), "params", w, no));
  } catch (const Error& e) {
    if (e.code() == no) throw;
    refuse(cat("attribute params does not hold valid parameter records: ", e.what()));
  } catch (const std::exception& e) {  // not JSON, or fields of the wrong type
    refuse(cat("attribute params does not hold valid parameter records: ", e.what()));
  }
  Hid common = group(meta.get(), "common", "/_shardckpt/common", w);
  hdf5::for_each_attr(common.get(), w, [&](const char* name) {
    contents.common.emplace(name, hdf5::read_value(common.get(), name, w, no));
  });
  contents.checksummed = false;
  if (version < 2) return;

  for (const char* name : {"checkpoint_id", "checksums"})
    if (!hdf5::has_attr(meta.get(), name, w)) refuse(cat("/_shardckpt has no attribute ", name));
  contents.id = hdf5::read_string(meta.get(), "checkpoint_id", w, no);
  if (contents.id.size() != 32 || contents.id.find_first_not_of("0123456789abcdef") != std::string::npos)
    refuse("attribute checkpoint_id is not 32 hex digits");
  const std::string scheme = hdf5::read_string(meta.get(), "checksums", w, no);
  if (scheme == no_checksums) return;
  if (scheme != checksum_scheme) refuse("attribute checksums names a checksum scheme this library does not know");
  checksummed = contents.checksummed = true;
  (void)group(meta.get(), "slabs", "/_shardckpt/slabs", w);
  read_checksum_table(meta.get(), w);
}

// The checksum table is read by address only: a table stored any other way (chunked, external,
// virtual) is refused rather than read through HDF5.
void ReaderState::read_checksum_table(hid_t meta, const Where& w) {
  const Errc no = Errc::not_a_checkpoint;
  if (!hdf5::hard_link_exists(meta, "checksums", w) || hdf5::object_type(meta, "checksums", w) != H5O_TYPE_DATASET)
    refuse("it has no /_shardckpt/checksums dataset");
  const Where cw{path, checksums_set, "read the checksum table"};
  checksums = owned(H5Dopen2(meta, "checksums", H5P_DEFAULT), H5Dclose, cw, no);
  Hid type = owned(H5Dget_type(checksums.get()), H5Tclose, cw, no);
  const std::vector<std::int64_t> shape = hdf5::shape_of(checksums.get(), cw, no);
  if (shape.size() != 1 || hdf5::dtype_of(type.get()) != DType::u64)
    refuse("/_shardckpt/checksums is not a 1-D table of u64");
  checksum_count = shape[0];
  if (checksum_count == 0) return;
  Hid dcpl = owned(H5Dget_create_plist(checksums.get()), H5Pclose, cw, no);
  const bool plain = H5Pget_external_count(dcpl.get()) == 0 && H5Pget_layout(dcpl.get()) == H5D_CONTIGUOUS;
  H5Eclear2(H5E_DEFAULT);
  const std::vector<RawRegion> table =
      plain ? raw_regions_of(checksums.get(), type.get(), shape, DType::u64, cw) : std::vector<RawRegion>{};
  if (table.size() != 1) refuse("its checksum table is not stored contiguously in the file");
  const std::uint64_t bytes = static_cast<std::uint64_t>(checksum_count) * sizeof(std::uint64_t);
  if (table[0].address > file_size || bytes > file_size - table[0].address)
    refuse("its checksum table ends past the end of the file (truncated)");
  checksums_address = table[0].address;
}

// Opens the file itself, in its directory, which stays open for the external files beside it.
void ReaderState::open(const fs::path& p) {
  path = p;
  const fs::path target = io::follow_links(p);
  const std::string name = target.filename().string();
  if (io::is_temporary_name(name))
    refuse("it is the temporary file of a save that did not finish, or is still running (docs/cluster.md: "
           "remove it once no save runs)");
  std::error_code ec;
  const fs::path parent = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  if (!fs::is_directory(parent, ec)) refuse("no such file");
  dir = io::Directory::open(parent);
  if (!dir.status(name)) refuse("no such file");
  try {
    file = dir.open_regular(name, Errc::not_a_checkpoint);
  } catch (const Error& e) {
    if (e.code() == Errc::not_a_checkpoint) refuse(e.what());
    throw;
  }
  file_size = file.size();
}

CheckpointReader::CheckpointReader(const fs::path& path, OpenOptions options) : impl_(std::make_unique<ReaderState>()) {
  ReaderState& m = *impl_;
  m.open(path);
  // Before HDF5 reads a byte: damaged metadata of a sealed file never reaches HDF5's parser, and
  // with a current seal every later read is checked again (a file changed in place is an error).
  std::optional<Seal> seal = check_seal(m.file, options.trusted_seal);
  if (options.require_seal && !seal)
    m.refuse("it has no seal, so its metadata cannot be checked before HDF5 reads it");
  if (seal) {
    m.seal = seal->digest;
    m.sealed = std::move(seal->pages);
  }
  m.raw.emplace(m.path, m.dir, m.file);
  m.channel = m.sealed ? std::make_unique<hdf5::Channel>(m.file, *m.sealed) : std::make_unique<hdf5::Channel>(m.file);
  try {
    m.h5 = hdf5::open_file(*m.channel, false, Errc::not_a_checkpoint);
  } catch (const Error& e) {
    if (e.code() == Errc::io || e.code() == Errc::corrupt) throw;
    m.refuse(cat("not an HDF5 file HDF5 can open (", e.what(), ")"));
  }
  m.hdf5.emplace(m.path, m.h5.get());
  m.read_metadata();
}

CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;
CheckpointReader::~CheckpointReader() = default;

// The entry of a dataset, its header read on first use (only the datasets a rank looks at).
// Under the index's lock, so that two threads never read one header; the entry itself, never changed
// after, is read without it.
const ReaderState::Entry& ReaderState::entry(std::string_view key) const {
  const auto held = index.lock();
  const auto it = held->find(key);
  if (it != held->end()) return it->second;
  const std::string name(key);
  const Where w{path, name, "find the dataset"};
  require(name != meta_group && io::plain_name(name) && hdf5::link_exists(h5.get(), name.c_str(), w),
          Errc::missing_key, "key ", key, " is not in ", path.string());
  return held->try_emplace(name, read_header(name)).first->second;
}

ReaderState::Entry::Header ReaderState::read_header(const std::string& name) const {
  Entry::Header e;
  const Where dw{path, name, "read the dataset header"};
  const Errc no = Errc::not_a_checkpoint;
  if (std::optional<std::string> link = hdf5::link_kind(h5.get(), name.c_str(), dw)) {
    e.skipped = cat(*link, " (not followed)");
    e.link = std::move(link);
    return e;
  }
  if (hdf5::object_type(h5.get(), name.c_str(), dw) != H5O_TYPE_DATASET) {
    e.skipped = "not a dataset";
    return e;
  }
  Hid set = owned(H5Dopen2(h5.get(), name.c_str(), H5P_DEFAULT), H5Dclose, dw, no);
  Hid type = owned(H5Dget_type(set.get()), H5Tclose, dw, no);
  const std::optional<DType> dtype = hdf5::dtype_of(type.get());
  if (!dtype) {
    e.skipped = "an element type shardckpt does not store";
    return e;
  }
  if (hdf5::null_dataspace(set.get(), dw, no)) {
    e.skipped = "a dataset without a value (a null dataspace)";
    return e;
  }
  std::vector<std::int64_t> shape = hdf5::shape_of(set.get(), dw, no);  // [] for a scalar, a tensor too
  Dataset info{name, *dtype, std::move(shape)};
  read_storage(set.get(), name, e, dw);
  if (hdf5::has_attr(set.get(), "global_shape", dw)) {
    // A local file's piece: its box in the global dataset (earlier files kept an N-D offset instead).
    PiecePlacement p{name, hdf5::read_ints(set.get(), "global_shape", 0, 32, dw, no), {}};
    try {
      if (hdf5::has_attr(set.get(), "global_key", dw)) p.key = hdf5::read_string(set.get(), "global_key", dw, no);
      if (hdf5::has_attr(set.get(), "global_box", dw)) {
        const std::vector<std::int64_t> b = hdf5::read_ints(set.get(), "global_box", 0, 4, dw, no);
        require(b.size() == 4, Errc::not_a_checkpoint, "global_box is not 4 values");
        p.box = {{b[0], b[1]}, {b[2], b[3]}};
      } else {
        p.box = footprint(name, p.global_shape, hdf5::read_ints(set.get(), "global_offset", 0, 32, dw, no), info.shape);
      }
      const Box whole = whole_box(p.global_shape);
      require(p.box.rows.begin >= 0 && p.box.rows.begin <= p.box.rows.end && p.box.rows.end <= whole.rows.end &&
                  p.box.cols.begin >= 0 && p.box.cols.begin <= p.box.cols.end && p.box.cols.end <= whole.cols.end &&
                  box_elements(p.box) == element_count(info.shape),
              Errc::not_a_checkpoint, "its box does not fit the global shape or the dataset");
    } catch (const Error& e) {
      refuse(cat("dataset ", name, ": its placement (global_shape, global_box) is not valid: ", e.what()));
    }
    info.placement = std::move(p);
  }
  e.info = std::move(info);
  return e;
}

// How the dataset's bytes are stored, refusing what the reader cannot read as the file means it.
// Virtual datasets (bytes in other files, and fill values where those are missing) are refused;
// bytes in another file (external storage) must sit in one plain file of the checkpoint's own
// directory, which the reader opens itself (a file could otherwise make a load read any file its
// user can, /etc/shadow, say); data that was never stored (HDF5 would read its fill value) is
// refused.
void ReaderState::read_storage(hid_t set, const std::string& name, Entry::Header& e, const Where& w) const {
  Hid dcpl = owned(H5Dget_create_plist(set), H5Pclose, w, Errc::not_a_checkpoint);
  if (H5Pget_layout(dcpl.get()) == H5D_VIRTUAL)
    refuse(cat("dataset ", name, " is an HDF5 virtual dataset (its bytes live in other files, and read as fill ",
               "values where those are missing): shardckpt does not read virtual datasets"));
  const int n = H5Pget_external_count(dcpl.get());
  if (n < 0) refuse(cat("dataset ", name, ": its external storage cannot be read"));
  if (n > 0) {
    char file[256] = {};
    off_t offset = 0;
    hsize_t size = 0;
    if (n != 1 || H5Pget_external(dcpl.get(), 0, sizeof file, file, &offset, &size) < 0 ||
        std::strlen(file) >= sizeof file - 1 || !io::plain_name(file) || offset < 0)
      refuse(cat("dataset ", name, " keeps its bytes in '", std::string_view(file, strnlen(file, sizeof file)), "'",
                 n > 1 ? " and other files" : "", ", not a plain file beside the checkpoint"));
    e.external = file;
    e.external_offset = static_cast<std::uint64_t>(offset);
    return;
  }
  if (!fully_stored(set, dcpl.get(), w))
    refuse(cat("dataset ", name, " has elements that were never stored (HDF5 would read them as its fill value)"));
}

const ReaderState::Entry& ReaderState::tensor_entry(std::string_view key) const {
  const Entry& e = entry(key);
  if (!e.info) refuse(cat("the object ", key, " is ", e.skipped, ", not a tensor"));
  return e;
}

const Dataset& ReaderState::info(std::string_view key) const { return *tensor_entry(key).info; }

const fs::path& CheckpointReader::path() const noexcept { return impl_->path; }
int CheckpointReader::version() const noexcept { return impl_->version; }
bool CheckpointReader::checksummed() const noexcept { return impl_->checksummed; }
io::FileIdentity CheckpointReader::identity() const { return impl_->file.identity(); }
std::optional<std::uint64_t> CheckpointReader::seal() const noexcept { return impl_->seal; }
const CheckpointContents& CheckpointReader::contents() const noexcept { return impl_->contents; }

std::uint64_t CheckpointReader::fingerprint() const {
  const ReaderState& m = *impl_;
  std::string text = cat(m.contents.id, "\n", m.seal.value_or(0), "\n", m.file_size, "\n", m.version, "\n",
                         static_cast<int>(m.contents.kind), "\n", records_json(m.contents.params), "\n");
  for (const auto& [key, value] : m.contents.common)
    std::visit(
        [&](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, double>)
            text += cat(key.size(), ":", key, "=f", std::bit_cast<std::uint64_t>(v), ";");
          else if constexpr (std::is_same_v<T, std::string>)
            text += cat(key.size(), ":", key, "=s", v.size(), ":", v, ";");
          else
            text += cat(key.size(), ":", key, "=i", v, ";");
        },
        value);
  return row_hash(text.data(), text.size());
}

const std::vector<ParamRecord>& CheckpointReader::params() const {
  const ReaderState& m = *impl_;
  return m.checked_params.get([&] {
    check_records(
        m.contents.params, [&](const std::string& key) -> const Dataset& { return m.info(key); },
        [&](const ParamRecord& r, std::string_view why) {
          m.refuse(cat("attribute params: the record of ", r.key, " ", why));
        });
    return m.contents.params;
  });
}

namespace {

const ReaderState::Listing& listing(const ReaderState& m) {
  return m.listing.get([&] {
    ReaderState::Listing out;
    for (const std::string& name : hdf5::link_names(m.h5.get(), {m.path, "", "list the datasets"})) {
      if (name == meta_group) continue;
      const ReaderState::Entry& e = m.entry(name);
      // A link names another object (h5py reads a soft or external link's target as if it were
      // here): a checkpoint holds its tensors itself, and one that lists a tensor it does not hold
      // is not one the library can copy or load whole.
      if (e.link) m.refuse(cat(name, " is ", *e.link, ": a checkpoint holds its datasets itself and shardckpt follows ",
                               "no links (remove it: del f['", name, "'] in h5py)"));
      if (e.info)
        out.all.push_back(*e.info);
      else
        out.skipped.emplace_back(name, e.skipped);
    }
    return out;
  });
}

}  // namespace

const std::vector<Dataset>& CheckpointReader::datasets() const { return listing(*impl_).all; }

const std::vector<std::pair<std::string, std::string>>& CheckpointReader::skipped() const {
  return listing(*impl_).skipped;
}

const Dataset& CheckpointReader::dataset(std::string_view key) const { return impl_->info(key); }

std::vector<Slab> CheckpointReader::slabs(const Dataset& d) const {
  const ReaderState& m = *impl_;
  return m.slabs_for(m.tensor_entry(d.key)).slabs;
}

}  // namespace shardckpt
