// The settings (csrc/settings.h): parsing every valid and invalid value of
// the three variables, and the cache (read once, reload_settings re-reads).
#include <c10/util/Exception.h>

#include <string>

#include "settings.h"
#include "support.h"
#include "env.h"

using Catch::Matchers::Contains;
using openwam::CudnnPreference;
using openwam::PadMode;
using openwam::Settings;
using openwam_test::kCheckFiniteVar;
using openwam_test::kCudnnVar;
using openwam_test::kFrontendVar;
using openwam_test::kPadVar;
using openwam_test::ScopedEnv;
using openwam_test::ScopedSettings;

namespace {

// All three unset for the duration of a test (the cache untouched).
struct CleanEnv {
  ScopedEnv cudnn{kCudnnVar, nullptr};
  ScopedEnv pad{kPadVar, nullptr};
  ScopedEnv check{kCheckFiniteVar, nullptr};
  ScopedEnv frontend{kFrontendVar, nullptr};
};

std::string parse_error() {
  return openwam_test::error_of([] { openwam::settings_from_environment(); });
}

}  // namespace

TEST_CASE("settings: defaults with nothing set", "[settings]") {
  CleanEnv clean;
  const Settings s = openwam::settings_from_environment();
  CHECK(s.cudnn == CudnnPreference::kFollowPyTorch);
  CHECK(s.pad == PadMode::kAuto);
  CHECK_FALSE(s.check_finite);
  CHECK(s.frontend);
}

TEST_CASE("settings: empty values mean unset", "[settings]") {
  CleanEnv clean;
  ScopedEnv cudnn(kCudnnVar, "");
  ScopedEnv pad(kPadVar, "");
  ScopedEnv check(kCheckFiniteVar, "");
  const Settings s = openwam::settings_from_environment();
  CHECK(s.cudnn == CudnnPreference::kFollowPyTorch);
  CHECK(s.pad == PadMode::kAuto);
  CHECK_FALSE(s.check_finite);
}

TEST_CASE("settings: OPENWAM_SDPA_CUDNN values", "[settings]") {
  CleanEnv clean;
  ScopedEnv e(kCudnnVar, "1");
  CHECK(openwam::settings_from_environment().cudnn == CudnnPreference::kPrefer);
  e.set("0");
  CHECK(openwam::settings_from_environment().cudnn == CudnnPreference::kNever);
  e.set(nullptr);
  CHECK(openwam::settings_from_environment().cudnn == CudnnPreference::kFollowPyTorch);
  for (const char* bad : {"2", "yes", "true", "on", " 1", "1 ", "01", "-1", "auto"}) {
    CAPTURE(bad);
    e.set(bad);
    CHECK_THROWS_AS(openwam::settings_from_environment(), c10::Error);
    CHECK(parse_error() == std::string("openwam::sdpa: environment variable "
                                       "OPENWAM_SDPA_CUDNN must be unset, '1' or '0', "
                                       "got '") + bad + "'");
  }
}

TEST_CASE("settings: OPENWAM_SDPA_PAD values", "[settings]") {
  CleanEnv clean;
  ScopedEnv e(kPadVar, "auto");
  CHECK(openwam::settings_from_environment().pad == PadMode::kAuto);
  e.set("always");
  CHECK(openwam::settings_from_environment().pad == PadMode::kAlways);
  e.set("never");
  CHECK(openwam::settings_from_environment().pad == PadMode::kNever);
  e.set(nullptr);
  CHECK(openwam::settings_from_environment().pad == PadMode::kAuto);
  for (const char* bad : {"sometimes", "1", "0", "on", "AUTO", "Always", " never"}) {
    CAPTURE(bad);
    e.set(bad);
    CHECK_THROWS_AS(openwam::settings_from_environment(), c10::Error);
    CHECK(parse_error() == std::string("openwam::sdpa: environment variable "
                                       "OPENWAM_SDPA_PAD must be 'auto', 'always' or "
                                       "'never', got '") + bad + "'");
  }
}

TEST_CASE("settings: OPENWAM_SDPA_CHECK_FINITE values", "[settings]") {
  CleanEnv clean;
  ScopedEnv e(kCheckFiniteVar, "1");
  CHECK(openwam::settings_from_environment().check_finite);
  e.set("0");
  CHECK_FALSE(openwam::settings_from_environment().check_finite);
  for (const char* bad : {"yes", "2", "true", "on", "00"}) {
    CAPTURE(bad);
    e.set(bad);
    CHECK_THROWS_AS(openwam::settings_from_environment(), c10::Error);
    CHECK(parse_error() == std::string("openwam::sdpa: environment variable "
                                       "OPENWAM_SDPA_CHECK_FINITE must be unset, '0' or "
                                       "'1', got '") + bad + "'");
  }
}

TEST_CASE("settings: OPENWAM_SDPA_FRONTEND values", "[settings]") {
  CleanEnv clean;
  ScopedEnv e(kFrontendVar, "0");
  CHECK_FALSE(openwam::settings_from_environment().frontend);
  e.set("1");
  CHECK(openwam::settings_from_environment().frontend);
  e.set("");
  CHECK(openwam::settings_from_environment().frontend);
  for (const char* bad : {"yes", "2", "off", "false", "00"}) {
    CAPTURE(bad);
    e.set(bad);
    CHECK_THROWS_AS(openwam::settings_from_environment(), c10::Error);
    CHECK(parse_error() == std::string("openwam::sdpa: environment variable "
                                       "OPENWAM_SDPA_FRONTEND must be unset, '0' or "
                                       "'1', got '") + bad + "'");
  }
}

TEST_CASE("settings: the variables are independent", "[settings]") {
  CleanEnv clean;
  const char* cudnn_values[] = {nullptr, "1", "0"};
  const char* pad_values[] = {nullptr, "always", "never"};
  const char* check_values[] = {nullptr, "1"};
  for (const char* c : cudnn_values) {
    for (const char* p : pad_values) {
      for (const char* f : check_values) {
        CAPTURE(c ? c : "unset", p ? p : "unset", f ? f : "unset");
        ScopedEnv ce(kCudnnVar, c), pe(kPadVar, p), fe(kCheckFiniteVar, f);
        const Settings s = openwam::settings_from_environment();
        CHECK(s.cudnn == (c == nullptr             ? CudnnPreference::kFollowPyTorch
                          : std::string(c) == "1" ? CudnnPreference::kPrefer
                                                  : CudnnPreference::kNever));
        CHECK(s.pad == (p == nullptr                  ? PadMode::kAuto
                        : std::string(p) == "always" ? PadMode::kAlways
                                                     : PadMode::kNever));
        CHECK(s.check_finite == (f != nullptr));
      }
    }
  }
  // The first invalid variable names itself, whatever the others hold.
  ScopedEnv ce(kCudnnVar, "1"), pe(kPadVar, "bad"), fe(kCheckFiniteVar, "1");
  CHECK_THAT(parse_error(), Contains(kPadVar) && Contains("'bad'"));
}

TEST_CASE("settings: current_settings is cached until reload_settings", "[settings]") {
  ScopedSettings pinned("0", "never", "1");
  Settings s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kNever);
  CHECK(s.pad == PadMode::kNever);
  CHECK(s.check_finite);

  // A changed environment is not seen...
  ScopedEnv cudnn(kCudnnVar, "1");
  ScopedEnv pad(kPadVar, "always");
  ScopedEnv check(kCheckFiniteVar, nullptr);
  s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kNever);
  CHECK(s.pad == PadMode::kNever);
  CHECK(s.check_finite);
  // ...not even an invalid one...
  {
    ScopedEnv bad(kPadVar, "bad");
    CHECK_NOTHROW(openwam::current_settings());
    CHECK(openwam::current_settings().pad == PadMode::kNever);
  }
  // ...until reload_settings, which returns the new settings.
  s = openwam::reload_settings();
  CHECK(s.cudnn == CudnnPreference::kPrefer);
  CHECK(s.pad == PadMode::kAlways);
  CHECK_FALSE(s.check_finite);
  s = openwam::current_settings();
  CHECK(s.cudnn == CudnnPreference::kPrefer);
  CHECK(s.pad == PadMode::kAlways);
  CHECK_FALSE(s.check_finite);
}

TEST_CASE("settings: every packed combination survives the cache", "[settings]") {
  for (const char* c : {"", "1", "0"}) {
    for (const char* p : {"auto", "always", "never"}) {
      for (const char* f : {"0", "1"}) {
        for (const char* fe : {"0", "1"}) {
          CAPTURE(c, p, f, fe);
          ScopedSettings pinned(c, p, f, fe);
          const Settings parsed = openwam::settings_from_environment();
          const Settings cached = openwam::current_settings();
          CHECK(cached.cudnn == parsed.cudnn);
          CHECK(cached.pad == parsed.pad);
          CHECK(cached.check_finite == parsed.check_finite);
          CHECK(cached.frontend == parsed.frontend);
        }
      }
    }
  }
}

TEST_CASE("settings: an invalid value raises until it is fixed", "[settings]") {
  ScopedSettings pinned;
  ScopedEnv cudnn(kCudnnVar, "yes");
  const std::string expected =
      "openwam::sdpa: environment variable OPENWAM_SDPA_CUDNN must be unset, '1' or "
      "'0', got 'yes'";
  CHECK_THROWS_AS(openwam::reload_settings(), c10::Error);
  // The failed reload leaves no cache behind: every later read raises too.
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(openwam_test::error_of([] { openwam::current_settings(); }) == expected);
  }
  CHECK(openwam_test::error_of([] { openwam::reload_settings(); }) == expected);

  SECTION("fixed: current_settings parses again without a reload") {
    cudnn.set("0");
    CHECK(openwam::current_settings().cudnn == CudnnPreference::kNever);
    // and caches what it parsed
    cudnn.set("yes");
    CHECK(openwam::current_settings().cudnn == CudnnPreference::kNever);
  }
  SECTION("fixed: reload_settings") {
    cudnn.set("1");
    CHECK(openwam::reload_settings().cudnn == CudnnPreference::kPrefer);
    CHECK(openwam::current_settings().cudnn == CudnnPreference::kPrefer);
  }
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
