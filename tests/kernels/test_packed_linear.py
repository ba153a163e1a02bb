"""The packed-weight CPU kernels against the ops they stand in for: torch's linear, kiln::scaled_mm."""

import pytest
import torch
import torch.nn.functional as F

import kiln.kernels  # noqa: F401
from kiln.kernels import gemms
from kiln.kernels import packed_linear, quantize_weight
from kiln.models import lm_head
from kiln.models.lm_head import Int8Head, PackedHead

ops = torch.ops.kiln
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_onednn_linear_matches_linear(dtype, bias, rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, 80).to(dtype), torch.randn(rows, 80).to(dtype)
    b = torch.randn(96).to(dtype) if bias else None
    try:
        packed = gemms.pack("onednn", w)
    except RuntimeError as e:  # gemm_choice rejects the format then ("packing failed"), keeping aten's GEMM
        assert dtype == torch.bfloat16 and "bf16 path needs the cpu support" in str(e)
        pytest.skip(f"oneDNN packs no bf16 weights on this CPU: {e}")
    assert packed_linear.is_packed(packed) and packed.shape == w.shape and packed.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for weight in (packed, w):  # the op also takes the weight as loaded
        out = ops.onednn_linear(x, weight, b)
        assert out.dtype == dtype and out.shape == (rows, 96)
        torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def _int8_exact(weight_max: int = 127):
    if not packed_linear.int8_gemm_exact(weight_max):
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI): kiln never chooses it here")


@pytest.mark.parametrize("weight_max", [127, packed_linear.W7A8_MAX])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_onednn_int8_linear_is_exact_int32_accumulation(rows, weight_max):
    """8-bit weight codes where the CPU has VNNI; 7-bit (w7a8) codes on any x86 CPU, where no pair of
    u8 x s8 products saturates int16."""
    _int8_exact(weight_max)
    torch.manual_seed(0)
    a = torch.randint(-127, 128, (rows, 1000), dtype=torch.int8)
    a[0] = 127  # the extreme codes, where a pairwise int16 accumulation would saturate
    w = torch.randint(-weight_max, weight_max + 1, (48, 1000), dtype=torch.int8)
    w[1] = -weight_max
    ref = torch._int_mm(torch.cat([a, a.new_zeros(40 - rows, 1000)]), w.t())[:rows].float()  # >16 rows
    for weight in (gemms.pack("onednn_int8", w), w):
        out = ops.onednn_int8_linear(packed_linear.shift_int8(a), weight)
        assert out.dtype == torch.float32
        assert torch.equal(out, ref)  # the same int32 sums, converted to fp32 the same way


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fbgemm_int8_linear_is_exact_where_a_pairwise_sum_would_saturate(rows):
    if not packed_linear.fbgemm_available():
        pytest.skip("this torch has no fbgemm quantized linear")
    torch.manual_seed(0)
    k = 2000
    a = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    a[0] = 127  # 8-bit codes straight into fbgemm's AVX2 kernel: 255 x 127 twice overflows int16
    a[-1, ::2] = -127
    w = torch.randint(-127, 128, (48, k), dtype=torch.int8)
    w[1], w[2] = -127, 127
    ref = (a.double() @ w.double().t()).float()  # int32 sums (|sum| < 2^24 here: exact in fp32 too)
    packed = gemms.pack("fbgemm_int8", w)
    assert packed_linear.is_packed(packed) and packed.shape == w.shape
    for weight in (packed, w):
        out = packed_linear.fbgemm_int8_linear(a, weight)
        assert out.dtype == torch.float32 and out.shape == (rows, 48)
        assert torch.equal(out, ref)


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fbgemm_w7a8_linear_is_exact_on_7_bit_weights_and_full_int8_activations(rows):
    if not packed_linear.fbgemm_available():
        pytest.skip("this torch has no fbgemm quantized linear")
    torch.manual_seed(0)
    k, top = 2000, packed_linear.W7A8_MAX
    a = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
    a[0] = 127  # shifted to 255: 255 x 63 twice is the largest pair, just inside int16
    a[-1, ::2] = -127
    w = torch.randint(-top, top + 1, (48, k), dtype=torch.int8)
    w[1], w[2] = -top, top
    ref = (a.double() @ w.double().t()).float()
    for weight in (gemms.pack("fbgemm_w7a8", w), w):
        out = packed_linear.fbgemm_w7a8_linear(a, weight)
        assert out.dtype == torch.float32 and out.shape == (rows, 48)
        assert torch.equal(out, ref)


def test_int8_shift_round_trips_every_code():
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    shifted = packed_linear.shift_int8(codes)
    assert shifted.dtype == torch.uint8
    assert torch.equal(shifted.to(torch.int16) - packed_linear.INT8_ZERO_POINT, codes.to(torch.int16))


def test_fp8_widened_weight_gives_scaled_mm_numbers():
    torch.manual_seed(0)
    w, s_w = quantize_weight(torch.randn(64, 48), torch.float8_e4m3fn)
    a, s_a = ops.quant_fp8(torch.randn(6, 48))
    ref = ops.scaled_mm(a, w, s_a, s_w, torch.float32, None)
    out = ops.onednn_linear(a.float(), gemms.pack("onednn_fp8_as_fp32", w)) * s_w * s_a
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_lm_heads_match_the_plain_matmul():
    torch.manual_seed(0)
    weight, hidden = torch.randn(500, 64), torch.randn(3, 64)
    ref = hidden @ weight.t()
    torch.testing.assert_close(PackedHead(weight)(hidden), ref, atol=1e-4, rtol=1e-4)
    int8 = Int8Head(weight)(hidden)
    assert int8.dtype == torch.float32
    # per-token activations and per-channel weights at 8 bits: within ~1% of the logits' spread
    assert ((int8 - ref).abs().max() / ref.abs().max()).item() < 0.02
    assert torch.equal(int8.argmax(-1), ref.argmax(-1))
    w7 = Int8Head(weight, packed_linear.W7A8_MAX)
    assert w7.kernel == ("onednn_int8" if packed_linear.int8_gemm_exact() else  # torch._int_mm's numbers on 7-bit codes
                         "fbgemm_w7a8" if packed_linear.fbgemm_available() else None)
    plain = Int8Head(weight, packed_linear.W7A8_MAX)
    plain.kernel, plain.codes = None, quantize_weight(weight, torch.int8, packed_linear.W7A8_MAX)[0]
    torch.testing.assert_close(w7(hidden), plain(hidden), atol=1e-5, rtol=1e-5)
    assert ((w7(hidden) - ref).abs().max() / ref.abs().max()).item() < 0.04


@pytest.mark.skipif(not packed_linear.fbgemm_available(), reason="this torch has no fbgemm")
@pytest.mark.parametrize("weight_max", [None, packed_linear.W7A8_MAX])
def test_fbgemm_head_in_row_blocks_gives_int_mm_numbers(monkeypatch, weight_max):
    """A head of more rows than FBGEMM_PACK_ROWS is packed and run in blocks (uneven ones too):
    the logits are torch._int_mm's, as from one weight."""
    monkeypatch.setattr(lm_head, "FBGEMM_PACK_ROWS", 128)
    monkeypatch.setattr(packed_linear, "int8_gemm_exact", lambda *args: False)  # fbgemm even where oneDNN is exact
    torch.manual_seed(0)
    weight, hidden = torch.randn(500, 64), torch.randn(5, 64)
    blocked = Int8Head(weight, weight_max)
    assert blocked.kernel.startswith("fbgemm") and [b.shape[0] for b in blocked.codes] == [125] * 4
    plain = Int8Head(weight, weight_max)
    plain.kernel, plain.codes = None, quantize_weight(weight, torch.int8, weight_max)[0]
    torch.testing.assert_close(blocked(hidden), plain(hidden), atol=1e-5, rtol=1e-5)
