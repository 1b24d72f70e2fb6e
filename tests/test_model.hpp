// Helpers of the suites that use the library and the demo model (include after test_support.hpp and
// the standard headers: it imports the modules).
#pragma once
#include <gtest/gtest.h>
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

}  // namespace testing_support
