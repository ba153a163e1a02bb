"""kiln's panel GEMM compiles into the piece that calls it: no call table, the kernel's source in the
piece, and the reference op's numbers at any token count, with and without bias."""

import pytest
import torch

from kiln.compiler import panel_lowering
from kiln.kernels import panel_linear
from tests.compiler.test_onednn_lowering import _library

ops = torch.ops.kiln
pytestmark = pytest.mark.skipif(not panel_lowering.register() or panel_linear.available((32, 8), torch.float32),
                                reason="kiln's panel GEMM is not available on this CPU and torch")


def test_pack_keeps_the_shape_and_unpacks_to_the_weight():
    w = torch.randn(48, 24)
    packed = panel_linear.pack(w)
    assert packed.shape == w.shape and packed.stride() == w.stride() and not torch.equal(packed, w)
    flat = packed.flatten()  # panel 0 (rows 0-15), K = 0, then K = 1; panel 1 starts at 16 * K
    assert torch.equal(flat[:16], w[:16, 0]) and torch.equal(flat[16:32], w[:16, 1])
    assert torch.equal(flat[16 * 24:16 * 25], w[16:32, 0])
    assert torch.equal(panel_linear.unpack(packed), w)


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_timing_kernel_gives_the_reference_numbers(rows):
    w, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    run = panel_linear.timing_kernel()
    packed = panel_linear.pack(w)
    torch.testing.assert_close(run(x, packed, bias), torch.addmm(bias, x, w.t()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(run(x, packed), x @ w.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ops.panel_linear(x, packed, bias), torch.addmm(bias, x, w.t()))


def test_projection_runs_the_kernel_inside_the_piece(tmp_path):
    def fn(x, w1, b1, w2):
        return ops.panel_linear(torch.relu(ops.panel_linear(x, w1, b1)) * 2, w2)

    w1, b1, w2 = torch.randn(48, 32), torch.randn(48), torch.randn(32, 48)
    run, source = _library(fn, [torch.randn(5, 32), w1, b1, w2], tmp_path)
    assert source.count("aoti_torch_cpu_kiln_panel_linear(") == 3  # its definition and the two calls
    assert source.count("void kiln_panel_gemm(") == 1  # spliced once
    packed = [panel_linear.pack(w1), b1, panel_linear.pack(w2)]
    for rows in (1, 7, 16, 40):
        x = torch.randn(rows, 32)
        [out] = run(x, *packed)  # the kernel sums K in order, torch's GEMM in blocks
        torch.testing.assert_close(out, fn(x, *packed), rtol=1e-4, atol=1e-4)


def test_compiled_model_on_the_panel_gemm_decodes_like_eager(demo_dirs, tmp_path_factory, monkeypatch):
    """The demo llama with every projection on the panel GEMM (the choice's timings forced): the
    runtime packs the weights the manifest names, the pieces run the kernel in C++ (the op's Python
    reference, patched to fail, is never called), and the tokens are eager's."""
    from kiln import LLM, SamplingParams
    from kiln.compiler import artifact
    from kiln.passes import gemm_choice
    from tests.oracle import PROMPTS

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_choice, "_streamed_time", lambda fn, args: 0.5 if fn.kernel == "panels16" else 2.0)
        mp.setattr(gemm_choice, "MIN_TIMED_ELEMENTS", 0)  # the demo's projections are time-worthy here
        compiled = LLM(demo_dirs["llama"], compile=True, cache_dir=tmp_path_factory.mktemp("panels"))
    layers = compiled.model_config.num_layers
    for variant in artifact.read_manifest(compiled.artifact_path)["variants"]:
        assert sorted(variant["weight_formats"].values()) == ["panels16"] * 4 * layers
    monkeypatch.setattr(panel_linear, "unpack", lambda w: pytest.fail("the reference op ran, not the kernel"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    got, ref = compiled.generate(PROMPTS, params), LLM(demo_dirs["llama"]).generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
