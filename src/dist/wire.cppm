// shardckpt.dist:wire (implementation partition): the wire format of the save and load protocols:
// little structs as length-prefixed binary (claims, parameter records, common values, datasets, file
// identities), written and read by every rank of the library's own collectives. Never tensor data;
// a message that is truncated or malformed is an error, never a read past its end.
module;
#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>
module shardckpt.dist:wire;
import shardckpt.core;
import shardckpt.layout;
import shardckpt.views;
import shardckpt.storage;
import shardckpt.merge;

namespace shardckpt {

using Bytes = std::vector<std::byte>;

// A digest of bytes ranks compare (not a defence against an adversary: against a process group that
// garbles or mixes up what it delivers, and against members that disagree on what they pass).
inline std::uint64_t digest(std::span<const std::byte> bytes) {
  return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

class Writer {
 public:
  void u8(std::uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void i64(std::int64_t v) { put(&v, sizeof v); }
  void f64(double v) { put(&v, sizeof v); }
  void str(std::string_view s) {
    i64(static_cast<std::int64_t>(s.size()));
    put(s.data(), s.size());
  }
  void dims(std::span<const std::int64_t> v) {
    i64(static_cast<std::int64_t>(v.size()));
    put(v.data(), v.size() * sizeof(std::int64_t));
  }
  void bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  Bytes take() { return std::move(out_); }

 private:
  void put(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  Bytes out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(*take(1).data()); }
  std::int64_t i64() { return get<std::int64_t>(); }
  double f64() { return get<double>(); }
  std::string str() {
    const auto b = take(length());
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  std::vector<std::int64_t> dims() {
    std::vector<std::int64_t> v(length());
    const auto b = take(v.size() * sizeof(std::int64_t));
    if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
    return v;
  }
  std::span<const std::byte> rest() { return take(in_.size() - pos_); }

 private:
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v).data(), sizeof v);
    return v;
  }
  std::size_t length() {
    const std::int64_t n = i64();
    require(n >= 0 && static_cast<std::size_t>(n) <= in_.size() - pos_, Errc::collective, "a malformed message");
    return static_cast<std::size_t>(n);
  }
  std::span<const std::byte> take(std::size_t n) {
    require(n <= in_.size() - pos_, Errc::collective, "a truncated message");
    const auto out = in_.subspan(pos_, n);
    pos_ += n;
    return out;
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

inline void put_box(Writer& w, const Box& b) {
  for (std::int64_t v : {b.rows.begin, b.rows.end, b.cols.begin, b.cols.end}) w.i64(v);
}

inline Box get_box(Reader& r) {
  Box b;
  b.rows.begin = r.i64();
  b.rows.end = r.i64();
  b.cols.begin = r.i64();
  b.cols.end = r.i64();
  return b;
}

// A claim as its rank sends it (claims_of: the plan's items stamped with the rank) and as rank 0
// reads it back; the rank is who sent it, not a field on the wire.
inline void put_claim(Writer& w, const Claim& c) {
  w.str(c.key);
  w.u8(static_cast<std::uint8_t>(c.dtype));
  w.dims(c.global_shape);
  put_box(w, c.box);
  w.u8(c.writes);
}

inline Claim get_claim(Reader& r, int rank) {
  Claim c;
  c.key = r.str();
  c.dtype = static_cast<DType>(r.u8());
  c.global_shape = r.dims();
  c.box = get_box(r);
  c.rank = rank;
  c.writes = r.u8() != 0;
  return c;
}

inline void put_record(Writer& w, const ParamRecord& p) {
  w.str(p.key);
  w.u8(static_cast<std::uint8_t>(p.tp_axis));
  w.i64(static_cast<std::int64_t>(p.blocks.size()));
  for (const Section& s : p.blocks) {
    w.str(s.name);
    w.i64(s.rows);
  }
  w.dims(p.trailing);
  w.i64(static_cast<std::int64_t>(p.divisors.size()));
  for (const TpDivisor& d : p.divisors) {
    w.str(d.name);
    w.i64(d.count);
  }
}

inline ParamRecord get_record(Reader& r) {
  ParamRecord p;
  p.key = r.str();
  p.tp_axis = static_cast<TpAxis>(r.u8());
  for (std::int64_t n = r.i64(); n > 0; --n) {
    std::string name = r.str();
    p.blocks.push_back({std::move(name), r.i64()});
  }
  p.trailing = r.dims();
  for (std::int64_t n = r.i64(); n > 0; --n) {
    std::string name = r.str();
    p.divisors.push_back({std::move(name), r.i64()});
  }
  return p;
}

inline void put_common(Writer& w, const Values& common) {
  w.i64(static_cast<std::int64_t>(common.size()));
  for (const auto& [key, value] : common) {
    w.str(key);
    w.u8(static_cast<std::uint8_t>(value.index()));
    if (const auto* i = std::get_if<std::int64_t>(&value)) w.i64(*i);
    if (const auto* d = std::get_if<double>(&value)) w.f64(*d);
    if (const auto* s = std::get_if<std::string>(&value)) w.str(*s);
  }
}

inline Values get_common(Reader& r) {
  Values out;
  for (std::int64_t n = r.i64(); n > 0; --n) {
    std::string key = r.str();
    switch (r.u8()) {
      case 0:
        out.emplace(std::move(key), r.i64());
        break;
      case 1:
        out.emplace(std::move(key), r.f64());
        break;
      default:
        out.emplace(std::move(key), r.str());
        break;
    }
  }
  return out;
}

inline void put_dataset(Writer& w, const Dataset& d) {
  w.str(d.key);
  w.u8(static_cast<std::uint8_t>(d.dtype));
  w.dims(d.shape);
  w.i64(static_cast<std::int64_t>(d.regions.size()));
  for (const RawRegion& e : d.regions) {
    for (std::int64_t v : {e.box.rows.begin, e.box.rows.end, e.box.cols.begin, e.box.cols.end}) w.i64(v);
    w.i64(static_cast<std::int64_t>(e.address));
    w.i64(e.runs);
    w.i64(e.period);
  }
}

inline Dataset get_dataset(Reader& r) {
  Dataset d;
  d.key = r.str();
  d.dtype = static_cast<DType>(r.u8());
  d.shape = r.dims();
  for (std::int64_t n = r.i64(); n > 0; --n) {
    RawRegion e;
    e.box.rows.begin = r.i64();
    e.box.rows.end = r.i64();
    e.box.cols.begin = r.i64();
    e.box.cols.end = r.i64();
    e.address = static_cast<std::uint64_t>(r.i64());
    e.runs = r.i64();
    e.period = r.i64();
    d.regions.push_back(e);
  }
  return d;
}

inline void put_identity(Writer& w, const io::SharedIdentity& id) {
  w.i64(static_cast<std::int64_t>(id.file.device));
  w.i64(static_cast<std::int64_t>(id.file.inode));
  w.i64(static_cast<std::int64_t>(id.machine));
}

inline io::SharedIdentity get_identity(Reader& r) {
  io::SharedIdentity id;
  id.file.device = static_cast<std::uint64_t>(r.i64());
  id.file.inode = static_cast<std::uint64_t>(r.i64());
  id.machine = static_cast<std::uint64_t>(r.i64());
  return id;
}

}  // namespace shardckpt
