// Helpers shared by the state suites (tests/state/*_test.cpp), the tests for shardckpt.state:
// state dicts, save preprocessing, loads at any layout, factory merges against the complete tree on
// the global and the local path, and errors that change nothing.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "test_support.hpp"
#include "test_model.hpp"
import shardckpt;
import shardckpt.demo;

using namespace shardckpt;
using testing_support::error_of;
using testing_support::file_bytes;
using testing_support::ScratchDir;

namespace {

inline demo::ModelConfig small_model() {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 1;
  c.dims = {.heads = 4, .head_dim = 4, .groups = 2, .state = 4, .householder = 2};
  c.cols = 24;
  return c;
}

inline void save_model(const demo::ModelConfig& c, const demo::Layout& l, const std::filesystem::path& path,
                       IoMethod method = IoMethod::raw) {
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    demo::RankModel m = demo::build_rank(c, l, g.rank());
    save(m.state, path, g, {method});
  });
}

// Loads at `l` on every rank and returns the number of mismatches against the pattern.
inline std::int64_t load_mismatches(const demo::ModelConfig& c, const demo::Layout& l,
                                    const std::filesystem::path& path) {
  std::atomic<std::int64_t> bad{0}, values{0};
  run_ranks(l.ranks(), [&](ProcessGroup& g) {
    const LoadedState s = load(path, demo::request(c, l, g.rank()), g);
    const demo::Verification v = demo::verify(c, {}, g.rank(), demo::request(c, l, g.rank()), s);
    EXPECT_EQ(v.mismatches, 0) << v.first_mismatch;
    bad += v.mismatches;
    values += v.values;
  });
  EXPECT_GT(values.load(), 0);
  return bad.load();
}

inline float as_f32(TensorView b, std::size_t i) {
  return b.dtype() == DType::bf16 ? to_f32(b.as<bf16>()[i]) : b.as<float>()[i];
}

// The spec's reference layer: GDP sections (10, 3, 2, 3) at TP 2 (dI 10, gS 3, nH 2), 8 columns.
inline demo::ModelConfig reference_model() {
  demo::ModelConfig c;
  c.gdp_layers = 1;
  c.mamba_layers = 0;
  c.dims = {.heads = 4, .head_dim = 5, .groups = 2, .state = 3, .householder = 3};
  c.cols = 8;
  return c;
}

}  // namespace
