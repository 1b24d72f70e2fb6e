// Helpers of the suites that use the library and the demo model (include after test_support.hpp and
// the standard headers: it imports the modules).
#pragma once
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
import shardckpt;
import shardckpt.demo;

namespace testing_support {

// The error `fn` throws; a test failure when it throws none.
template <class Fn>
shardckpt::Error error_of(Fn&& fn) {
  try {
    fn();
  } catch (const shardckpt::Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return shardckpt::Error(shardckpt::Errc::internal, "no error");
}

// A demo model of one GDP and one Mamba layer, small enough for many ranks and layouts: TP 1, 2 and
// 4 divide its heads and groups (TP 8 divides the rows of every block, but not its 4 groups).
inline shardckpt::demo::ModelConfig tiny_model() {
  shardckpt::demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  c.dims = {.heads = 8, .head_dim = 2, .groups = 4, .state = 4, .householder = 2};
  c.cols = 16;
  return c;
}

// Mismatches against the demo pattern after loading `path` at `l` into host memory (each failing
// the test), on l.ranks() thread ranks.
inline std::int64_t host_mismatches(const shardckpt::demo::ModelConfig& c, const shardckpt::demo::Layout& l,
                                    const std::filesystem::path& path, const shardckpt::demo::Training& t = {}) {
  namespace sc = shardckpt;
  std::atomic<std::int64_t> bad{0};
  sc::run_ranks(l.ranks(), [&](sc::ProcessGroup& g) {
    sc::StateDict model = sc::demo::with_destinations(sc::demo::request(c, l, g.rank(), t));
    const sc::Values values = sc::load_into(path, model, g);
    const sc::demo::Verification v = sc::demo::verify(c, t, g.rank(), model, values);
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    EXPECT_GT(v.values, 0);
    bad += v.mismatches;
  });
  return bad.load();
}

}  // namespace testing_support
