// User settings, read from the environment on every call so that a training
// script (or a test) can change them between calls. Invalid values raise.
#pragma once

#include <string>

namespace openwam {

// OPENWAM_SDPA_CUDNN: unset = the backend PyTorch itself picks; 1 = cuDNN
// whenever cuDNN can serve the inputs; 0 = never cuDNN.
enum class CudnnPreference { kFollowPyTorch, kPrefer, kNever };

// OPENWAM_SDPA_PAD: auto (default) = the guard table decides which calls need
// a fix and the cheapest exact fix is used; always = pad K/V to a multiple of
// 128 on every differentiated call (inside the backward on cuDNN, on the
// inputs elsewhere); never = no fix at all (stock behaviour, for measuring).
enum class PadMode { kAuto, kAlways, kNever };

struct Settings {
  CudnnPreference cudnn = CudnnPreference::kFollowPyTorch;
  PadMode pad = PadMode::kAuto;
  // OPENWAM_SDPA_CHECK_FINITE=1: debug mode; the backward synchronises and
  // raises when a gradient is not finite.
  bool check_finite = false;
};

Settings current_settings();

const char* to_string(CudnnPreference p);
const char* to_string(PadMode p);

}  // namespace openwam
