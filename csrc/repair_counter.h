// Telemetry of the dQ-row repair: the GPU counts the rows it recomputed, and
// openwam_sdpa.repaired_rows() reads the count at a step boundary. Reading is
// the only synchronisation; nothing on the hot path waits for it.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace openwam {

// The device's counter (an int64 in device memory), allocated on first use.
// nullptr while a CUDA graph is being captured on a device whose counter does
// not exist yet (allocating then would tie it to the graph's memory pool):
// such calls repair without counting.
int64_t* repaired_rows_counter(const c10::Device& device);

// The sum of every device's counter (synchronises); zeroes them if `reset`.
int64_t read_repaired_rows(bool reset);

}  // namespace openwam
