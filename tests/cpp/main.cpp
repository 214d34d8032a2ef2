// Catch2 v2's main(); the test cases live in the other files of tests/cpp.
// Kept alone in its own file so that editing a test does not recompile it.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
