// Telemetry of the dQ-row repair: the GPU counts the rows it recomputed, and
// openwam_sdpa.repaired_rows() reads the count at a step boundary. Reading is
// the only synchronisation; nothing on the hot path waits for it.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace openwam {

// The device's counter (an int64 in device memory), allocated on first use
// (cudaMalloc, zeroed, then a synchronisation of the current stream).
// nullptr while the current stream is capturing a CUDA graph on a device
// whose counter does not exist yet (that stream can be neither zeroed
// outside the graph nor synchronised): such calls repair without counting.
int64_t* repaired_rows_counter(const c10::Device& device);

// The sum of every device's counter (synchronises); zeroes them if `reset`.
int64_t read_repaired_rows(bool reset);

}  // namespace openwam
