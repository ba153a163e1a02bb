// kiln::panel_int4_linear as a C shim function; after panel_int4_linear.cpp
#include "aoti_shim.h"

static AOTITorchError aoti_torch_cpu_kiln_panel_int4_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                            AtenTensorHandle scales, AtenTensorHandle* ret) {
  const int64_t *x_sizes = kiln_shim_sizes(x), *w_sizes = kiln_shim_sizes(w), *s_sizes = kiln_shim_sizes(scales);
  const int64_t sizes[2] = {x_sizes[0], w_sizes[0]};
  float* out = (float*)kiln_shim_empty(2, sizes, aoti_torch_dtype_float32(), ret);
  kiln_panel_int4_gemm((const int8_t*)kiln_shim_data(x), (const uint8_t*)kiln_shim_data(w),
                       (const float*)kiln_shim_data(scales), out, x_sizes[0], w_sizes[0], x_sizes[1], s_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
