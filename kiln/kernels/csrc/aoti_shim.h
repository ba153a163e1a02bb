// What each of kiln's C shim functions does around its kernel: read its tensors' sizes and data, and allocate
// its output. A shim is spliced into the wrapper AOTInductor generates for a piece or a library, which
// declares torch's C shim API and AOTI_TORCH_ERROR_CODE_CHECK (a failed call throws); several kernels' shims
// may land in one wrapper: the guard keeps this once.
#ifndef KILN_AOTI_SHIM_H
#define KILN_AOTI_SHIM_H

// The largest output rank `kiln_shim_empty` makes
#define KILN_SHIM_MAX_DIM 8

// t's sizes, torch's own array (alive while t is)
static inline int64_t* kiln_shim_sizes(AtenTensorHandle t) {
  int64_t* sizes;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(t, &sizes));
  return sizes;
}

// t's data
static inline void* kiln_shim_data(AtenTensorHandle t) {
  void* data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(t, &data));
  return data;
}

// A new contiguous CPU tensor of `dtype` (an aoti_torch_dtype_*()) and sizes [dim] into *ret; its data
static inline void* kiln_shim_empty(int64_t dim, const int64_t* sizes, int32_t dtype, AtenTensorHandle* ret) {
  int64_t strides[KILN_SHIM_MAX_DIM];
  int64_t stride = 1;
  for (int64_t d = dim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= sizes[d];
  }
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(dim, sizes, strides, dtype, aoti_torch_device_type_cpu(), 0,
                                                       ret));
  return kiln_shim_data(*ret);
}

#endif  // KILN_AOTI_SHIM_H
