"""W4A8: 4-bit weight codes in groups, their byte layouts (kiln's, compressed-tensors', the panel
GEMM's), and the panel GEMM against the op's reference, exactly."""

import numpy as np
import pytest
import torch

from kiln.kernels import panel_linear
from kiln.kernels.quant import (dequantize_int4, int4_group_size, int4_scaled_mm, pack_nibbles, quantize_weight_int4,
                                unpack_nibbles)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_quantized_codes_and_scales_per_group():
    w = torch.randn(48, 256)
    w[3, 130] = 40.0  # an outlier widens only its own group's scale
    codes, scales = quantize_weight_int4(w, 128)
    assert codes.shape == (48, 128) and codes.dtype == torch.uint8 and scales.shape == (48, 2)
    q = unpack_nibbles(codes)
    assert q.abs().max() <= 7
    torch.testing.assert_close(scales, w.view(48, 2, 128).abs().amax(-1) / 7)
    err = (dequantize_int4(codes, scales) - w).abs().view(48, 2, 128)
    assert (err <= scales[..., None] / 2 + 1e-6).all()  # round to nearest
    assert scales[3, 1] > 5 * scales[3, 0]
    assert int4_group_size(896) == 128 and int4_group_size(96) == 32 and int4_group_size(100) is None


def test_bytes_are_compressed_tensors_pack_quantized_words():
    """Eight codes + 8 to an int32, the first in the lowest bits (compressed-tensors' pack_to_int32):
    read as bytes on a little-endian CPU, that is `pack_nibbles`."""
    codes = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    u = (codes.numpy().astype(np.int64) + 8).astype(np.uint32)
    words = np.zeros((5, 8), dtype=np.uint32)
    for i in range(8):
        words |= u[:, i::8] << (4 * i)
    as_bytes = torch.from_numpy(words.view(np.int32)).view(torch.uint8)
    assert torch.equal(as_bytes, pack_nibbles(codes))
    assert torch.equal(unpack_nibbles(as_bytes), codes)


def test_panel_layout():
    codes = torch.randint(-8, 8, (32, 64), dtype=torch.int8)
    plain = pack_nibbles(codes)
    packed = panel_linear.pack_int4(plain)
    assert packed.shape == plain.shape and torch.equal(panel_linear.unpack_int4(packed), plain)
    line = packed.view(2, 8, 64)[1, 2]  # panel 1, K 16..23: byte 4c + j = K 16 + j, high nibble K 20 + j
    for c, j in ((0, 0), (5, 3), (15, 1)):
        assert (line[4 * c + j] & 0xF).item() == codes[16 + c, 16 + j] + 8
        assert (line[4 * c + j] >> 4).item() == codes[16 + c, 20 + j] + 8


def test_scales_are_packed_per_panel():
    """As the fp32 panel GEMM's weight: each panel's [groups, 16], in order."""
    scales = torch.rand(32, 3)
    packed = panel_linear.pack(scales)
    assert torch.equal(packed.view(2, 3, 16)[1, 2], scales[16:, 2])  # panel 1, group 2: its 16 channels' scales
    assert torch.equal(panel_linear.unpack(packed), scales)


def test_reference_sums_each_group_exactly():
    a = torch.randint(-127, 128, (3, 64), dtype=torch.int8)
    codes = torch.randint(-8, 8, (16, 64), dtype=torch.int8)
    scales = torch.rand(16, 2) + 0.5
    a_scale = torch.rand(3, 1)
    want = sum((a[:, g * 32:(g + 1) * 32].long() @ codes[:, g * 32:(g + 1) * 32].long().t()).double() * scales[:, g].double()
               for g in range(2)) * a_scale.double()
    got = int4_scaled_mm(a, pack_nibbles(codes), a_scale, scales, torch.float32)
    # exact integer sums; fp32 only in the scale products and the sum of two groups (which may cancel)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("m, n, k, group", [(1, 16, 64, 32), (5, 48, 512, 64), (8, 64, 256, 128), (9, 32, 384, 128),
                                            (20, 96, 896, 128), (3, 32, 72, 8)])
def test_panel_gemm_gives_the_references_numbers(m, n, k, group):
    if (why := panel_linear.available((n, k // 2), torch.uint8, k // group)) is not None:
        pytest.skip(f"the int4 panel GEMM does not run here: {why}")
    gemm = panel_linear.timing_kernel(panel_linear.INT4)
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    codes[0] = -8  # the extremes: codes + 8 in 0..15 times +-127, shifted back per group
    codes[1] = 7
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    a[0, : k // 2] = 127
    a[-1] = -127
    scales = torch.rand(n, k // group) * 0.01 + 1e-3
    plain = pack_nibbles(codes)
    want = int4_scaled_mm(a, plain, torch.ones(m, 1), scales, torch.float32)
    packed, packed_scales = panel_linear.pack_int4(plain), panel_linear.pack(scales)
    got = gemm(a, packed, packed_scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(panel_linear.panel_int4_linear(a, packed, packed_scales), want)


def test_shapes_the_panel_gemm_refuses():
    assert "multiple of 16" in panel_linear.available((40, 64), torch.uint8, 1)
    assert "multiple of 8" in panel_linear.available((32, 64), torch.uint8, 32)  # groups of 4
