// The bf16 tile kernels of the dQ-row repair (see repair_dq_tile_launch.cuh).
#include "repair_dq_tile_launch.cuh"

namespace openwam {
namespace repair {

void launch_tiles_bf16(const TileParams& p, int device, cudaStream_t stream) {
  launch_tiles<Bf16>(p, device, stream);
}

}  // namespace repair
}  // namespace openwam
