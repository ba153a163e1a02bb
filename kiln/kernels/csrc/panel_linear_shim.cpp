// kiln::panel_linear as a C shim function (an optional tensor comes as a pointer to its handle), for
// the piece's wrapper to call like torch's own; after panel_linear.cpp
#include "aoti_shim.h"

static AOTITorchError aoti_torch_cpu_kiln_panel_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* bias,
                                                       AtenTensorHandle* ret) {
  const int64_t *x_sizes = kiln_shim_sizes(x), *w_sizes = kiln_shim_sizes(w);
  const int64_t sizes[2] = {x_sizes[0], w_sizes[0]};
  float* out = (float*)kiln_shim_empty(2, sizes, aoti_torch_dtype_float32(), ret);
  const float* bias_data = bias ? (const float*)kiln_shim_data(*bias) : nullptr;
  kiln_panel_gemm((const float*)kiln_shim_data(x), (const float*)kiln_shim_data(w), bias_data, out, x_sizes[0],
                  w_sizes[0], x_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
