// Environment guards. The settings are read once and cached
// (csrc/settings.h), so a test that wants the op to see other settings sets
// the variables with ScopedSettings, which reloads the cache on entry and
// again on exit; ScopedEnv alone changes only the environment.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

#include "settings.h"

namespace openwam_test {

// Sets (or, with nullptr, unsets) one variable; restores its old value on exit.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = std::string(old);
    }
    set(value);
  }
  ~ScopedEnv() { set(old_ ? old_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void set(const char* value) {
    if (value == nullptr) {
      ::unsetenv(name_);
    } else {
      ::setenv(name_, value, 1);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

constexpr const char* kCudnnVar = "OPENWAM_SDPA_CUDNN";
constexpr const char* kPadVar = "OPENWAM_SDPA_PAD";
constexpr const char* kCheckFiniteVar = "OPENWAM_SDPA_CHECK_FINITE";
constexpr const char* kFrontendVar = "OPENWAM_SDPA_FRONTEND";

// All four variables pinned (nullptr: unset) and the cache reloaded, for
// the duration of a scope; on exit the old environment and its settings.
class ScopedSettings {
 public:
  explicit ScopedSettings(const char* cudnn = nullptr, const char* pad = nullptr,
                          const char* check_finite = nullptr, const char* frontend = nullptr)
      : cudnn_(kCudnnVar, cudnn),
        pad_(kPadVar, pad),
        check_(kCheckFiniteVar, check_finite),
        frontend_(kFrontendVar, frontend) {
    openwam::reload_settings();
  }
  ScopedSettings(const ScopedSettings&) = delete;
  ScopedSettings& operator=(const ScopedSettings&) = delete;

 private:
  // Declared first, so destroyed last: reloads once the variables below are
  // restored. An invalid restored value leaves the cache unset, as it would
  // be for that environment.
  struct ReloadOnExit {
    ~ReloadOnExit() {
      try {
        openwam::reload_settings();
      } catch (...) {
      }
    }
  } reload_on_exit_;
  ScopedEnv cudnn_, pad_, check_, frontend_;
};

}  // namespace openwam_test
