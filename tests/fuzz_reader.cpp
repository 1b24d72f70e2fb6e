// libFuzzer target: file images opened, inspected, verified and loaded (see fuzz_one.hpp). Built
// with -Dfuzz=true in the sanitizer build; scripts/test.sh runs it for a bounded time from the seed
// corpus in tests/fuzz/corpus.
#include <cstddef>
#include <cstdint>

#include "fuzz_one.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  testing_support::fuzz_one_input(data, size);
  return 0;
}
