"""Quantization ops against dequantized references."""

import pytest
import torch

import kiln.kernels  # noqa: F401
from kiln.kernels import quantize_weight

ops = torch.ops.kiln
QUANTS = {"int8": (ops.quant_int8, torch.int8, 127.0), "fp8": (ops.quant_fp8, torch.float8_e4m3fn, 448.0)}


@pytest.mark.parametrize("kind", QUANTS)
def test_dynamic_per_token_quant_round_trips(kind):
    quant, dtype, qmax = QUANTS[kind]
    x = torch.randn(5, 64) * torch.tensor([0.01, 1, 10, 100, 0])[:, None]  # one scale per row, zero row too
    q, s = quant(x)
    assert q.dtype == dtype and q.shape == (5, 64) and s.shape == (5, 1)
    torch.testing.assert_close(s[:4, 0], x[:4].abs().amax(-1) / qmax)
    err = (q.float() * s - x).abs()
    if kind == "int8":
        assert (err <= s / 2 + 1e-7).all()  # round to nearest step
    else:  # e4m3: 3 mantissa bits, relative step 2^-3, so half of it; subnormals below 2^-6
        assert (err <= x.abs() / 16 + s * 2**-10 + 1e-7).all()
    assert (q[4].float() == 0).all()


@pytest.mark.parametrize("kind", QUANTS)
def test_static_per_tensor_quant_uses_the_given_scale_and_saturates(kind):
    quant, dtype, qmax = QUANTS[kind]
    x = torch.tensor([[0.5, -1.0, 3.0, -1000.0]])
    q, s = quant(x, torch.tensor([0.01]))
    assert s.shape == (1, 1) and s.item() == pytest.approx(0.01)
    assert q.float()[0, 3] == -qmax  # clamped, not wrapped
    torch.testing.assert_close(q.float()[0, :2] * 0.01, x[0, :2], atol=0.01 * qmax / 2**4, rtol=0)


@pytest.mark.parametrize("kind", QUANTS)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_scaled_mm_matches_dequantized_matmul(kind, rows):
    quant, dtype, _ = QUANTS[kind]
    x, w, bias = torch.randn(rows, 64), torch.randn(48, 64) * 0.05, torch.randn(48)
    qw, sw = quantize_weight(w, dtype)
    assert qw.dtype == dtype and sw.shape == (48,)
    qx, sx = quant(x)
    out = ops.scaled_mm(qx, qw, sx, sw, torch.float32, bias)
    ref = (qx.float() * sx) @ (qw.float() * sw[:, None]).T + bias
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    bf16 = ops.scaled_mm(qx, qw, sx, sw, torch.bfloat16, None)
    assert bf16.dtype == torch.bfloat16
    # and the whole W8A8 linear stays close to the full-precision one
    assert ((out - (x @ w.T + bias)).norm() / (x @ w.T + bias).norm()) < (0.02 if kind == "int8" else 0.06)


def test_weight_codes_stay_within_the_given_bound():
    w = torch.randn(40, 300) * 0.05
    w[3, 7] = 2.0  # one outlier sets its row's scale
    q, s = quantize_weight(w, torch.int8, 63)
    assert q.dtype == torch.int8 and q.abs().amax(dim=1).tolist() == [63] * 40
    torch.testing.assert_close(s, w.abs().amax(dim=1) / 63)
    torch.testing.assert_close(q.float() * s[:, None], w, atol=s.max().item() / 2, rtol=0)
    q8, s8 = quantize_weight(w, torch.int8)
    assert q8.abs().amax().item() == 127 and (q.float() * s[:, None] - w).norm() > (q8.float() * s8[:, None] - w).norm()


@pytest.mark.parametrize("kind", QUANTS)
def test_quant_ops_pass_opcheck(kind):
    quant, dtype, _ = QUANTS[kind]
    # opcheck's schema test compares outputs with arithmetic that float8 tensors do not support
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    if kind == "int8":
        utils += ("test_schema",)
    x = torch.randn(6, 32)
    torch.library.opcheck(quant, (x,), test_utils=utils)
    torch.library.opcheck(quant, (x, torch.tensor([0.02])), test_utils=utils)
    qw, sw = quantize_weight(torch.randn(16, 32), dtype)
    qx, sx = quant(x)
    torch.library.opcheck(ops.scaled_mm, (qx, qw, sx, sw, torch.float32, torch.randn(16)), test_utils=utils)
