// Settings read from the environment (csrc/settings.h).
#include <c10/util/Exception.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "settings.h"

// Catch2 last: c10/util/logging_is_not_google_glog.h defines a glog-style
// CHECK that aborts; catch.hpp's CHECK must be the one in force.
#undef CHECK
#include <catch2/catch.hpp>

#include "scoped_env.h"

using Catch::Matchers::Contains;
using openwam::CudnnPreference;
using openwam::PadMode;

namespace {

constexpr const char* kCudnn = "OPENWAM_SDPA_CUDNN";
constexpr const char* kPad = "OPENWAM_SDPA_PAD";
constexpr const char* kCheck = "OPENWAM_SDPA_CHECK_FINITE";

// All three unset for the duration of a test.
struct CleanEnv {
  ScopedEnv cudnn{kCudnn, nullptr};
  ScopedEnv pad{kPad, nullptr};
  ScopedEnv check{kCheck, nullptr};
};

}  // namespace

TEST_CASE("settings: defaults with nothing set", "[settings]") {
  CleanEnv clean;
  const openwam::Settings s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kFollowPyTorch);
  CHECK(s.pad == PadMode::kAuto);
  CHECK_FALSE(s.check_finite);
}

TEST_CASE("settings: empty values mean unset", "[settings]") {
  CleanEnv clean;
  ScopedEnv cudnn(kCudnn, "");
  ScopedEnv pad(kPad, "");
  ScopedEnv check(kCheck, "");
  const openwam::Settings s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kFollowPyTorch);
  CHECK(s.pad == PadMode::kAuto);
  CHECK_FALSE(s.check_finite);
}

TEST_CASE("settings: OPENWAM_SDPA_CUDNN", "[settings]") {
  CleanEnv clean;
  {
    ScopedEnv e(kCudnn, "1");
    CHECK(openwam::current_settings().cudnn == CudnnPreference::kPrefer);
  }
  {
    ScopedEnv e(kCudnn, "0");
    CHECK(openwam::current_settings().cudnn == CudnnPreference::kNever);
  }
  // Read on every call: back to the default once unset.
  CHECK(openwam::current_settings().cudnn == CudnnPreference::kFollowPyTorch);
  for (const char* bad : {"2", "yes", "true", " 1", "01"}) {
    CAPTURE(bad);
    ScopedEnv e(kCudnn, bad);
    CHECK_THROWS_AS(openwam::current_settings(), c10::Error);
    CHECK_THROWS_WITH(openwam::current_settings(),
                      Contains(kCudnn) && Contains("'" + std::string(bad) + "'"));
  }
}

TEST_CASE("settings: OPENWAM_SDPA_PAD", "[settings]") {
  CleanEnv clean;
  {
    ScopedEnv e(kPad, "auto");
    CHECK(openwam::current_settings().pad == PadMode::kAuto);
  }
  {
    ScopedEnv e(kPad, "always");
    CHECK(openwam::current_settings().pad == PadMode::kAlways);
  }
  {
    ScopedEnv e(kPad, "never");
    CHECK(openwam::current_settings().pad == PadMode::kNever);
  }
  CHECK(openwam::current_settings().pad == PadMode::kAuto);
  for (const char* bad : {"sometimes", "1", "0", "on"}) {
    CAPTURE(bad);
    ScopedEnv e(kPad, bad);
    CHECK_THROWS_AS(openwam::current_settings(), c10::Error);
    CHECK_THROWS_WITH(openwam::current_settings(),
                      Contains(kPad) && Contains("'" + std::string(bad) + "'"));
  }
}

TEST_CASE("settings: OPENWAM_SDPA_CHECK_FINITE", "[settings]") {
  CleanEnv clean;
  {
    ScopedEnv e(kCheck, "1");
    CHECK(openwam::current_settings().check_finite);
  }
  {
    ScopedEnv e(kCheck, "0");
    CHECK_FALSE(openwam::current_settings().check_finite);
  }
  for (const char* bad : {"yes", "2", "true"}) {
    CAPTURE(bad);
    ScopedEnv e(kCheck, bad);
    CHECK_THROWS_AS(openwam::current_settings(), c10::Error);
    CHECK_THROWS_WITH(openwam::current_settings(),
                      Contains(kCheck) && Contains("'" + std::string(bad) + "'"));
  }
}

TEST_CASE("settings: the variables are independent", "[settings]") {
  CleanEnv clean;
  ScopedEnv cudnn(kCudnn, "0");
  ScopedEnv pad(kPad, "never");
  ScopedEnv check(kCheck, "1");
  const openwam::Settings s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kNever);
  CHECK(s.pad == PadMode::kNever);
  CHECK(s.check_finite);
}

TEST_CASE("settings: names", "[settings]") {
  CHECK(std::string(openwam::to_string(CudnnPreference::kFollowPyTorch)) ==
        "follow_pytorch");
  CHECK(std::string(openwam::to_string(CudnnPreference::kPrefer)) == "prefer");
  CHECK(std::string(openwam::to_string(CudnnPreference::kNever)) == "never");
  CHECK(std::string(openwam::to_string(PadMode::kAuto)) == "auto");
  CHECK(std::string(openwam::to_string(PadMode::kAlways)) == "always");
  CHECK(std::string(openwam::to_string(PadMode::kNever)) == "never");
}
