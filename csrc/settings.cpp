#include "settings.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace openwam {
namespace {

// Unset and empty both mean "not set".
std::string env_value(const char* name) {
  const char* raw = std::getenv(name);
  return raw == nullptr ? std::string() : std::string(raw);
}

}  // namespace

Settings current_settings() {
  Settings s;

  const std::string cudnn = env_value("OPENWAM_SDPA_CUDNN");
  if (cudnn == "1") {
    s.cudnn = CudnnPreference::kPrefer;
  } else if (cudnn == "0") {
    s.cudnn = CudnnPreference::kNever;
  } else {
    TORCH_CHECK(cudnn.empty(),
                "openwam::sdpa: environment variable OPENWAM_SDPA_CUDNN must "
                "be unset, '1' or '0', got '", cudnn, "'");
  }

  const std::string pad = env_value("OPENWAM_SDPA_PAD");
  if (pad.empty() || pad == "auto") {
    s.pad = PadMode::kAuto;
  } else if (pad == "always") {
    s.pad = PadMode::kAlways;
  } else if (pad == "never") {
    s.pad = PadMode::kNever;
  } else {
    TORCH_CHECK(false,
                "openwam::sdpa: environment variable OPENWAM_SDPA_PAD must be "
                "'auto', 'always' or 'never', got '", pad, "'");
  }

  const std::string check = env_value("OPENWAM_SDPA_CHECK_FINITE");
  TORCH_CHECK(check.empty() || check == "0" || check == "1",
              "openwam::sdpa: environment variable OPENWAM_SDPA_CHECK_FINITE "
              "must be unset, '0' or '1', got '", check, "'");
  s.check_finite = check == "1";
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
