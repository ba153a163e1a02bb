"""W4A8: asymmetric 4-bit weight codes in groups, activations in blocks of 32, their byte layouts (kiln's,
compressed-tensors', the panel GEMM's), and the panel GEMM against the op's reference."""

import numpy as np
import pytest
import torch

from kiln.kernels import panel_linear
from kiln.kernels.quant import (ACT_BLOCK, dequantize_int4, int4_block_mm, pack_nibbles, quant_int8_blocked,
                                quantize_weight_int4, unpack_nibbles)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


def test_codes_span_each_groups_min_to_max():
    w = torch.randn(48, 256)
    w[3, 130] = 40.0  # an outlier widens only its own group's scale
    codes, scales, mins = quantize_weight_int4(w, 32)
    assert codes.shape == (48, 128) and codes.dtype == torch.uint8
    assert scales.shape == mins.shape == (48, 8) and scales.dtype == mins.dtype == torch.float16
    q = unpack_nibbles(codes).view(48, 8, 32)
    assert q.max() == 15 and (q.amin(-1) == 0).all()  # each group uses the whole range
    torch.testing.assert_close(mins.float(), w.view(48, 8, 32).amin(-1), rtol=1e-3, atol=0)
    err = (dequantize_int4(codes, scales, mins) - w).abs().view(48, 8, 32)
    assert (err <= scales.float()[..., None] * 0.51 + 2e-3).all()  # round to nearest, of the fp16 values stored
    assert scales[3, 4] > 5 * scales[3, 3]


def test_a_grid_of_fp16_scales_and_minimums_comes_back_exactly():
    """Weights that already are scale x code + min (a Q4_1 file dequantized) quantize to those very codes."""
    scales = (torch.rand(16, 4) * 0.01 + 1e-3).half()
    mins = (-torch.rand(16, 4) * 0.1).half()
    q = torch.randint(0, 16, (16, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # a group's extremes, as a min/max quantizer leaves them
    w = (q * scales.float()[..., None] + mins.float()[..., None]).view(16, 128)
    codes, got_scales, got_mins = quantize_weight_int4(w, 32)
    assert torch.equal(unpack_nibbles(codes).view(16, 4, 32), q.to(torch.uint8))
    torch.testing.assert_close(dequantize_int4(codes, got_scales, got_mins), w, rtol=0, atol=1e-6)


def test_bytes_are_compressed_tensors_pack_quantized_words():
    """Eight codes to an int32, the first in the lowest bits (compressed-tensors' pack_to_int32, its symmetric
    codes stored + 8): read as bytes on a little-endian CPU, that is `pack_nibbles`."""
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    u = codes.numpy().astype(np.uint32)
    words = np.zeros((5, 8), dtype=np.uint32)
    for i in range(8):
        words |= u[:, i::8] << (4 * i)
    as_bytes = torch.from_numpy(words.view(np.int32)).view(torch.uint8)
    assert torch.equal(as_bytes, pack_nibbles(codes))
    assert torch.equal(unpack_nibbles(as_bytes), codes)


def test_activations_take_a_scale_per_block():
    x = torch.randn(3, 128)
    x[1, 40] = 100.0  # an outlier coarsens only its own block
    q, s = quant_int8_blocked(x, 32)
    assert q.dtype == torch.int8 and s.shape == (3, 4)
    torch.testing.assert_close(s, x.view(3, 4, 32).abs().amax(-1) / 127)
    back = (q.float().view(3, 4, 32) * s[..., None]).view(3, 128)
    assert ((back - x).abs() <= s.repeat_interleave(32, 1) / 2 + 1e-6).all()
    assert s[1, 1] > 20 * s[1, 0]


def test_panel_layout():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    plain = pack_nibbles(codes)
    packed = panel_linear.pack_int4(plain)
    assert packed.shape == plain.shape and torch.equal(panel_linear.unpack_int4(packed), plain)
    line = packed.view(2, 8, 32)[1, 2]  # panel 1 (channels 8..15), K 16..23: byte 4c + j = K 16 + j, high K 20 + j
    for c, j in ((0, 0), (5, 3), (7, 1)):
        assert (line[4 * c + j] & 0xF).item() == codes[8 + c, 16 + j]
        assert (line[4 * c + j] >> 4).item() == codes[8 + c, 20 + j]


def test_groups_are_packed_per_panel():
    scales = torch.rand(16, 3).half()
    packed = panel_linear.pack_int4_groups(scales)
    assert torch.equal(packed.view(2, 3, 8)[1, 2], scales[8:, 2])  # panel 1, group 2: its 8 channels' scales
    assert torch.equal(panel_linear.unpack_int4_groups(packed), scales)


def test_reference_is_the_blocked_formula():
    a = torch.randint(-127, 128, (3, 128), dtype=torch.int8)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    scales, mins = torch.rand(8, 2).half() + 0.5, -torch.rand(8, 2).half()
    a_scale = torch.rand(3, 4)
    want = torch.zeros(3, 8, dtype=torch.float64)
    for b in range(4):
        g, part = b // 2, slice(b * 32, (b + 1) * 32)
        dots = a[:, part].long() @ codes[:, part].long().t()
        sums = a[:, part].long().sum(-1, keepdim=True)
        want += (dots.double() * scales[:, g].double() + sums.double() * mins[:, g].double()) * a_scale[:, b:b + 1].double()
    got = int4_block_mm(a, a_scale, pack_nibbles(codes), scales, mins, torch.float32)
    # exact integer sums; fp32 only in the scale products and the sums over blocks (which may cancel)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    w = dequantize_int4(pack_nibbles(codes), scales, mins)  # the same numbers as dequantized fp32 operands
    torch.testing.assert_close(got, (a.float().view(3, 4, 32) * a_scale[..., None]).view(3, 128) @ w.t(),
                               rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("m, n, k, group", [(1, 8, 32, 32), (5, 48, 512, 64), (4, 64, 256, 128), (9, 32, 384, 32),
                                            (20, 96, 896, 32), (3, 40, 96, 96)])
def test_panel_gemm_gives_the_references_numbers(m, n, k, group):
    if (why := panel_linear.available((n, k // 2), torch.uint8, k // group)) is not None:
        pytest.skip(f"the int4 panel GEMM does not run here: {why}")
    gemm = panel_linear.timing_kernel(panel_linear.INT4)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    codes[0], codes[1] = 0, 15  # the extremes, times +-127 and -128
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    a[0, : k // 2] = 127
    a[-1] = -128
    a_scale = torch.rand(m, k // ACT_BLOCK) * 0.01 + 1e-4
    scales = (torch.rand(n, k // group) * 0.01 + 1e-3).half()
    mins = (-torch.rand(n, k // group) * 0.05).half()
    plain = pack_nibbles(codes)
    want = int4_block_mm(a, a_scale, plain, scales, mins, torch.float32)
    packed = panel_linear.pack_int4(plain)
    packed_scales, packed_mins = panel_linear.pack_int4_groups(scales), panel_linear.pack_int4_groups(mins)
    got = gemm(a, a_scale, packed, packed_scales, packed_mins)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(panel_linear.panel_int4_linear(a, a_scale, packed, packed_scales, packed_mins), want)


def test_shapes_the_panel_gemm_refuses():
    assert "multiple of 8" in panel_linear.available((36, 64), torch.uint8, 1)
    assert "multiple of 32" in panel_linear.available((32, 64), torch.uint8, 8)  # groups of 16
