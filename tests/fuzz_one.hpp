// One fuzz input: a file image that the reader opens, inspects, verifies and loads a small request
// from. Shared by the libFuzzer target (fuzz_reader.cpp) and the unit tests that replay every
// input the fuzzer ever found crashing (tests/fuzz/regressions). No shardckpt types here, so that
// a file can include it before its imports.
#pragma once
#include <cstddef>
#include <cstdint>

namespace testing_support {
// Throws nothing; a crash, a sanitizer report or a hang is a bug.
void fuzz_one_input(const std::uint8_t* data, std::size_t size);
}  // namespace testing_support
