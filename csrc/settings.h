// User settings, read from the environment once and cached: every call reads
// the cache, so the hot path never touches the environment (a getenv and a
// string per variable per call used to cost host time on every attention
// call). reload_settings() re-reads the environment
// (openwam_sdpa.reload_settings() in Python). Invalid values raise.
#pragma once

namespace openwam {

// OPENWAM_SDPA_CUDNN: unset = the backend PyTorch itself picks; 1 = cuDNN
// whenever cuDNN can serve the inputs; 0 = never cuDNN.
enum class CudnnPreference { kFollowPyTorch, kPrefer, kNever };

// OPENWAM_SDPA_PAD: auto (default) = the guard table decides which calls need
// a fix; always = every differentiated cuDNN backward takes the fix (with a
// bool mask the score shift; otherwise cuDNN's padding mask, and on the ATen
// fallback K/V padded to a multiple of 128); never
// = no fix at all (stock behaviour, for measuring). Rules that keep a call off
// cuDNN (a crash) hold in every mode.
enum class PadMode { kAuto, kAlways, kNever };

struct Settings {
  CudnnPreference cudnn = CudnnPreference::kFollowPyTorch;
  PadMode pad = PadMode::kAuto;
  // OPENWAM_SDPA_CHECK_FINITE=1: debug mode; the backward synchronises and
  // raises when a gradient is not finite.
  bool check_finite = false;
  // OPENWAM_SDPA_FRONTEND=0: the cuDNN path runs ATen's cuDNN attention with
  // padded inputs, as it does for a configuration whose graph the frontend
  // cannot build (to compare, or to step around a frontend problem); 1, the
  // default: the op's own cuDNN graphs.
  bool frontend = true;
};

// Parses the environment now (raises on an invalid value).
Settings settings_from_environment();

// The cached settings; the first call parses the environment. A call that
// finds an invalid value raises, and so does every later one until the value
// is fixed and reload_settings() succeeds.
Settings current_settings();

// Re-reads the environment into the cache; returns the new settings.
Settings reload_settings();

const char* to_string(CudnnPreference p);
const char* to_string(PadMode p);

}  // namespace openwam
