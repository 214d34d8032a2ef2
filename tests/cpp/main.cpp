// Catch2 v2's main(); the test cases live in the other files of tests/cpp.
// Kept alone in its own file so that editing a test does not recompile it.
//
// One intra-op thread: the tests' tensors are small, and ctest runs test
// processes side by side; with ATen's default thread pool a leaf-op test
// took 20.8 s instead of 0.95 s on the 2-core dev box (OpenMP threads
// spinning against each other).
#define CATCH_CONFIG_RUNNER
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>

#undef CHECK
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  at::set_num_threads(1);
  // ATen seeds its CPU generator from the OS, so without this every run
  // draws other inputs. OPENWAM_TEST_SEED draws others on purpose.
  const char* seed = std::getenv("OPENWAM_TEST_SEED");
  at::manual_seed(seed != nullptr ? std::stoull(seed) : 0);
  return Catch::Session().run(argc, argv);
}
