// The host tests' tally (tests/cpp/*.cpp): CHECK(cond, fmt, ...) counts a pass, or counts a failure and prints it
// with its values (the first kMaxReported in full; the count covers the rest); finish() prints the final
// "N passed, N failed" line that tests/test_common_cpp.py and tests/test_v1_host.py look for and gives the exit code.
#pragma once

#include <cstdio>

namespace flashgen_test {

inline int g_passed = 0;
inline int g_failed = 0;
constexpr int kMaxReported = 30;

inline int finish() {
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

}  // namespace flashgen_test

#define CHECK(cond, ...)                                                          \
  do {                                                                            \
    if (cond) {                                                                   \
      ++flashgen_test::g_passed;                                                  \
    } else if (++flashgen_test::g_failed <= flashgen_test::kMaxReported) {        \
      std::printf("FAIL %s:%d: %s | ", __FILE__, __LINE__, #cond);                \
      std::printf(__VA_ARGS__);                                                   \
      std::printf("\n");                                                          \
    }                                                                             \
  } while (0)
