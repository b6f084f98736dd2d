// The card's figures the configuration reads (CardInfo, config.h).
#include "cuda_check.h"
#include "heuristics.h"

namespace megamoe::kernels {

double device_read_gbps_per_sm(int device) {
  int clock_khz = 0, bus_bits = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (clock_khz <= 0 || bus_bits <= 0 || sms <= 0) return 0;
  return 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9 / sms;
}

}  // namespace megamoe::kernels
