// kiln::greedy_screen as a C shim function; after greedy_screen.cpp
#include "aoti_shim.h"

static AOTITorchError aoti_torch_cpu_kiln_greedy_screen(AtenTensorHandle hidden, AtenTensorHandle codes,
                                                        AtenTensorHandle scales, AtenTensorHandle weight,
                                                        AtenTensorHandle params, AtenTensorHandle* ret) {
  const int64_t *h_sizes = kiln_shim_sizes(hidden), *t_sizes = kiln_shim_sizes(scales);
  const int64_t sizes[1] = {h_sizes[0]};
  int64_t* out = (int64_t*)kiln_shim_empty(1, sizes, aoti_torch_dtype_int64(), ret);
  kiln_greedy_screen((const float*)kiln_shim_data(hidden), (const uint8_t*)kiln_shim_data(codes),
                     (const float*)kiln_shim_data(scales), (const float*)kiln_shim_data(weight),
                     (const double*)kiln_shim_data(params), out, h_sizes[0], t_sizes[0], h_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
