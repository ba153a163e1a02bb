"""kiln's Triton kernels compile for an H100 (sm_90) at real model sizes.

No GPU needed: Triton's NVIDIA backend compiles to a cubin with the ptxas its wheel carries. The
interpreter tests (`triton_cases.py`) check the numbers on tiny shapes; this checks what only a real
compile sees: the NVIDIA lowering of every op, and shared memory at head dim 128 and big GQA groups. The
arguments are the launch's own (`launch_arguments`, or the norm and activation ops' launches
recorded instead of run), built from meta tensors, so no memory is used. The fp8 epilogues, which
the interpreter cannot check, compile here.
"""

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from kiln.kernels.triton import activation, attention, norm, rope_kv_cache  # noqa: E402
from tests.kernels.hopper import SHARED_LIMIT, compile_for_hopper, skip_without_ptxas, spilled_bytes  # noqa: E402,E501

skip_without_ptxas()


def _batch(tokens, num_seqs, q_heads, kv_heads, dim, dtype):
    meta = dict(device="meta")
    return (torch.empty(tokens, q_heads, dim, dtype=dtype, **meta),
            torch.empty(2, 1000, 16, kv_heads, dim, dtype=dtype, **meta),
            torch.empty(num_seqs + 1, dtype=torch.int32, **meta), torch.empty(num_seqs, dtype=torch.int32, **meta),
            torch.empty(num_seqs, 37, dtype=torch.int32, **meta))


@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 128), (14, 2, 64), (16, 16, 128)],
                         ids=["llama-8b", "llama-70b", "qwen2-0.5b", "mha"])
@pytest.mark.parametrize("batch", [(8, 8), (300, 3)], ids=["decodes", "prefills"])
def test_paged_attention_compiles_for_hopper(heads, batch):
    query, cache, starts, lens, tables = _batch(*batch, *heads, torch.bfloat16)
    out = torch.empty_like(query)
    _, args, constexprs = attention.launch_arguments(query, cache, starts, lens, tables, 0.1, 0, out, None)
    kernel = compile_for_hopper(attention._paged_attention_kernel, args, constexprs)
    assert kernel.metadata.shared <= SHARED_LIMIT and spilled_bytes(kernel) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # fp32: tl.dot in IEEE precision
@pytest.mark.parametrize("batch", [(8, 8), (300, 3)], ids=["decodes", "prefills"])
def test_paged_attention_compiles_for_hopper_in_other_dtypes(dtype, batch):
    query, cache, starts, lens, tables = _batch(*batch, 32, 8, 128, dtype)
    _, args, constexprs = attention.launch_arguments(query, cache, starts, lens, tables, 0.1, 0,
                                                     torch.empty_like(query), None)
    kernel = compile_for_hopper(attention._paged_attention_kernel, args, constexprs)
    assert kernel.metadata.shared <= SHARED_LIMIT and spilled_bytes(kernel) == 0


@pytest.mark.parametrize("quant_dtype", [torch.int8, torch.float8_e4m3fn])
def test_paged_attention_quant_compiles_for_hopper(quant_dtype):
    query, cache, starts, lens, tables = _batch(300, 3, 32, 8, 128, torch.bfloat16)
    out = torch.empty(300, 32 * 128, dtype=quant_dtype, device="meta")
    scale = torch.empty(1, 1, device="meta")
    _, args, constexprs = attention.launch_arguments(query, cache, starts, lens, tables, 0.1, 4096, out, scale)
    kernel = compile_for_hopper(attention._paged_attention_kernel, args, constexprs)
    assert kernel.metadata.shared <= SHARED_LIMIT and spilled_bytes(kernel) == 0


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads", [(32, 8, 128), (64, 8, 128)], ids=["llama-8b", "llama-70b"])
def test_rope_kv_cache_write_compiles_for_hopper(is_neox, heads):
    tokens, (q_heads, kv_heads, dim) = 64, heads
    qkv = torch.empty(tokens, (q_heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="meta")
    q, k, v = qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, q_heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    cache = torch.empty(2, 1000, 16, kv_heads, dim, dtype=torch.bfloat16, device="meta")
    positions = torch.empty(tokens, dtype=torch.int64, device="meta")
    cos_sin = torch.empty(8192, dim, dtype=torch.bfloat16, device="meta")
    _, args, constexprs = rope_kv_cache.launch_arguments(positions, q, k, v, cos_sin, is_neox, cache, positions,
                                                         torch.empty_like(q))
    kernel = compile_for_hopper(rope_kv_cache._rope_kv_kernel, args, constexprs)
    assert kernel.metadata.shared <= SHARED_LIMIT and spilled_bytes(kernel) == 0


class _Launch:
    """Stands in for `wrap_triton(kernel)`: `[grid](...)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((self.kernel, args, constexprs))


@pytest.mark.parametrize("quant", [None, (torch.int8, False), (torch.int8, True), (torch.float8_e4m3fn, False),
                                   (torch.float8_e4m3fn, True)],
                         ids=["plain", "int8-per-token", "int8-static", "fp8-per-token", "fp8-static"])
def test_norm_and_activation_kernels_compile_for_hopper(quant, monkeypatch):
    launches = []
    for module in (norm, activation):
        monkeypatch.setattr(module, "wrap_triton", lambda kernel: _Launch(kernel, launches))
    hidden, inter = 8192, 28672  # Llama-70B's rows: the widest common MLP
    x = torch.empty(64, hidden, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(hidden, dtype=torch.bfloat16, device="meta")
    args = () if quant is None else (quant[0], torch.empty(1, device="meta") if quant[1] else None)
    norm.rms_norm_triton(x, weight, 1e-6, *args)
    norm.fused_add_rms_norm_triton(x, torch.empty_like(x), weight, 1e-6, *args)
    activation.silu_and_mul_triton(torch.empty(64, 2 * inter, dtype=torch.bfloat16, device="meta"), *args)
    assert [kernel.__name__ for kernel, _, _ in launches] == ["_rms_norm_kernel", "_rms_norm_kernel",
                                                              "_silu_and_mul_kernel"]
    for kernel, launch_args, constexprs in launches:
        compiled = compile_for_hopper(kernel, launch_args, constexprs)
        assert compiled.metadata.shared <= SHARED_LIMIT and spilled_bytes(compiled) == 0
