import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import kiln.kernels  # noqa: F401

ops = torch.ops.kiln


def test_rms_norm_matches_formula_fp32():
    x, w = torch.randn(7, 64), torch.randn(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), ref, atol=1e-6, rtol=1e-5)


def test_rms_norm_bit_exact_with_hf_in_bf16():
    norm = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(64, dtype=torch.bfloat16)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)  # any rank: q/k norm runs on [T, heads, head_dim]
    assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6), norm(x))


def test_fused_add_rms_norm():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    out, res = ops.fused_add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, ops.rms_norm(x + r, w, 1e-6))


def test_silu_and_mul():
    gate, up = torch.randn(6, 48), torch.randn(6, 48)
    out = ops.silu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.shape == (6, 48)
    torch.testing.assert_close(out, F.silu(gate) * up)
