#include "settings.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace openwam {
namespace {

// Unset and empty both mean "not set".
const char* env_value(const char* name) {
  const char* raw = std::getenv(name);
  return raw == nullptr ? "" : raw;
}

bool is(const char* value, const char* expected) {
  return std::strcmp(value, expected) == 0;
}

// The cache: the four settings packed into one word, so that a call reads
// them with one relaxed atomic load. kUnset: not parsed yet (or the last
// parse raised).
constexpr int kUnset = -1;
std::atomic<int> g_packed{kUnset};

int pack(const Settings& s) {
  return static_cast<int>(s.cudnn) | static_cast<int>(s.pad) << 2 |
         static_cast<int>(s.check_finite) << 4 | static_cast<int>(s.frontend) << 5;
}

Settings unpack(int bits) {
  Settings s;
  s.cudnn = static_cast<CudnnPreference>(bits & 3);
  s.pad = static_cast<PadMode>((bits >> 2) & 3);
  s.check_finite = ((bits >> 4) & 1) != 0;
  s.frontend = ((bits >> 5) & 1) != 0;
  return s;
}

}  // namespace

Settings settings_from_environment() {
  Settings s;

  const char* cudnn = env_value("OPENWAM_SDPA_CUDNN");
  if (is(cudnn, "1")) {
    s.cudnn = CudnnPreference::kPrefer;
  } else if (is(cudnn, "0")) {
    s.cudnn = CudnnPreference::kNever;
  } else {
    TORCH_CHECK(is(cudnn, ""),
                "openwam::sdpa: environment variable OPENWAM_SDPA_CUDNN must "
                "be unset, '1' or '0', got '", cudnn, "'");
  }

  const char* pad = env_value("OPENWAM_SDPA_PAD");
  if (is(pad, "") || is(pad, "auto")) {
    s.pad = PadMode::kAuto;
  } else if (is(pad, "always")) {
    s.pad = PadMode::kAlways;
  } else if (is(pad, "never")) {
    s.pad = PadMode::kNever;
  } else {
    TORCH_CHECK(false,
                "openwam::sdpa: environment variable OPENWAM_SDPA_PAD must be "
                "'auto', 'always' or 'never', got '", pad, "'");
  }

  const char* check = env_value("OPENWAM_SDPA_CHECK_FINITE");
  TORCH_CHECK(is(check, "") || is(check, "0") || is(check, "1"),
              "openwam::sdpa: environment variable OPENWAM_SDPA_CHECK_FINITE "
              "must be unset, '0' or '1', got '", check, "'");
  s.check_finite = is(check, "1");

  const char* frontend = env_value("OPENWAM_SDPA_FRONTEND");
  TORCH_CHECK(is(frontend, "") || is(frontend, "0") || is(frontend, "1"),
              "openwam::sdpa: environment variable OPENWAM_SDPA_FRONTEND "
              "must be unset, '0' or '1', got '", frontend, "'");
  s.frontend = !is(frontend, "0");
  return s;
}

Settings current_settings() {
  const int bits = g_packed.load(std::memory_order_relaxed);
  return bits == kUnset ? reload_settings() : unpack(bits);
}

Settings reload_settings() {
  g_packed.store(kUnset, std::memory_order_relaxed);
  const Settings s = settings_from_environment();  // raises: the cache stays unset
  g_packed.store(pack(s), std::memory_order_relaxed);
  return s;
}

const char* to_string(CudnnPreference p) {
  switch (p) {
    case CudnnPreference::kFollowPyTorch: return "follow_pytorch";
    case CudnnPreference::kPrefer: return "prefer";
    case CudnnPreference::kNever: return "never";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown CudnnPreference");
}

const char* to_string(PadMode p) {
  switch (p) {
    case PadMode::kAuto: return "auto";
    case PadMode::kAlways: return "always";
    case PadMode::kNever: return "never";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PadMode");
}

}  // namespace openwam
