// kiln::panel_int8_block_linear and kiln::panel_int8_group_linear as C shim functions; after
// panel_int8_block_linear.cpp
#include "aoti_shim.h"

static AOTITorchError aoti_torch_cpu_kiln_panel_int8_block_linear(AtenTensorHandle a, AtenTensorHandle a_scales,
                                                                  AtenTensorHandle w, AtenTensorHandle* ret) {
  const int64_t *a_sizes = kiln_shim_sizes(a), *w_sizes = kiln_shim_sizes(w);
  const int64_t sizes[2] = {a_sizes[0], w_sizes[0]};
  float* out = (float*)kiln_shim_empty(2, sizes, aoti_torch_dtype_float32(), ret);
  kiln_panel_int8_block_gemm((const int8_t*)kiln_shim_data(a), (const float*)kiln_shim_data(a_scales),
                             (const int8_t*)kiln_shim_data(w), out, a_sizes[0], w_sizes[0], a_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}

// kiln::panel_int8_group_linear: the same kernel with the weight's fp16 scales per block
static AOTITorchError aoti_torch_cpu_kiln_panel_int8_group_linear(AtenTensorHandle a, AtenTensorHandle a_scales,
                                                                  AtenTensorHandle w, AtenTensorHandle scales,
                                                                  AtenTensorHandle* ret) {
  const int64_t *a_sizes = kiln_shim_sizes(a), *w_sizes = kiln_shim_sizes(w);
  const int64_t sizes[2] = {a_sizes[0], w_sizes[0]};
  float* out = (float*)kiln_shim_empty(2, sizes, aoti_torch_dtype_float32(), ret);
  kiln_panel_int8_group_gemm((const int8_t*)kiln_shim_data(a), (const float*)kiln_shim_data(a_scales),
                             (const int8_t*)kiln_shim_data(w), (const uint16_t*)kiln_shim_data(scales), out,
                             a_sizes[0], w_sizes[0], a_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
