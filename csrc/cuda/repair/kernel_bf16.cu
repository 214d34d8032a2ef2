// The bf16 kernels of the dQ-row repair (see launch.cuh).
#include "launch.cuh"

namespace openwam {
namespace repair {

void launch_repair_bf16(const ScanParams& scan, const TileParams& tiles, int device,
                        cudaStream_t stream, bool behind_backward) {
  launch_repair<Bf16>(scan, tiles, device, stream, behind_backward);
}

}  // namespace repair
}  // namespace openwam
