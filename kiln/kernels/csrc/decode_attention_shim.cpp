// kiln::decode_attention as a C shim function; after decode_attention.cpp
#include "aoti_shim.h"

static AOTITorchError aoti_torch_cpu_kiln_decode_attention(AtenTensorHandle query, AtenTensorHandle cache,
                                                           AtenTensorHandle tables, AtenTensorHandle lens,
                                                           AtenTensorHandle params, AtenTensorHandle* ret) {
  const int64_t *q_sizes = kiln_shim_sizes(query), *cache_sizes = kiln_shim_sizes(cache);
  const int64_t* table_sizes = kiln_shim_sizes(tables);
  float* out = (float*)kiln_shim_empty(3, q_sizes, aoti_torch_dtype_float32(), ret);
  int32_t cache_dtype;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(cache, &cache_dtype));
  if (cache_dtype == aoti_torch_dtype_int8())  // rows of D codes and a scale (kv_cache.py)
    kiln_decode_attention_int8((const float*)kiln_shim_data(query), (const int8_t*)kiln_shim_data(cache),
                               (const int32_t*)kiln_shim_data(tables), (const int32_t*)kiln_shim_data(lens),
                               (const float*)kiln_shim_data(params), out, q_sizes[0], q_sizes[1], q_sizes[2],
                               cache_sizes[1], cache_sizes[2], cache_sizes[3], table_sizes[1]);
  else
    kiln_decode_attention((const float*)kiln_shim_data(query), (const float*)kiln_shim_data(cache),
                          (const int32_t*)kiln_shim_data(tables), (const int32_t*)kiln_shim_data(lens),
                          (const float*)kiln_shim_data(params), out, q_sizes[0], q_sizes[1], q_sizes[2],
                          cache_sizes[1], cache_sizes[2], cache_sizes[3], table_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
