"""kiln's panel GEMMs compile into the piece that calls them: no call table, the kernel's source in
the piece, and the reference op's numbers at any token count (fp32 with and without bias; int8
exactly, on the extreme codes)."""

import pytest
import torch

from kiln.kernels import cpp_lowering, gemms, panel_linear
from tests.cache_tools.test_commands import kiln_cache_cmd
from tests.kernels.test_onednn_lowering import _library

ops = torch.ops.kiln
pytestmark = pytest.mark.skipif(not cpp_lowering.register()
                                or panel_linear.available((32, 8), torch.float32) is not None,
                                reason="kiln's panel GEMM is not available on this CPU and torch")
needs_int8 = pytest.mark.skipif(panel_linear.available((32, 8), torch.int8) is not None,
                                reason="kiln's int8 panel GEMM is not available on this CPU (no AVX512-VNNI)")


def _codes(*shape: int) -> torch.Tensor:
    """int8 codes with the extremes -128 and 127 in every row (where a saturating kernel goes wrong)."""
    codes = torch.randint(-128, 128, shape, dtype=torch.int8)
    codes[..., ::5], codes[..., 1::5] = -128, 127
    return codes


def test_pack_keeps_the_shape_and_unpacks_to_the_weight():
    w = torch.randn(48, 24)
    packed = panel_linear.pack(w)
    assert packed.shape == w.shape and packed.stride() == w.stride() and not torch.equal(packed, w)
    flat = packed.flatten()  # panel 0 (rows 0-15), K = 0, then K = 1; panel 1 starts at 16 * K
    assert torch.equal(flat[:16], w[:16, 0]) and torch.equal(flat[16:32], w[:16, 1])
    assert torch.equal(flat[16 * 24:16 * 25], w[16:32, 0])
    assert torch.equal(panel_linear.unpack(packed), w)


def test_int8_pack_groups_four_codes_of_each_channel_shifted_to_unsigned():
    w = _codes(32, 12)
    packed = panel_linear.pack_int8(w)
    assert packed.shape == w.shape and packed.dtype == torch.int8
    flat = packed.flatten().view(torch.uint8).long()  # panel 0, K 0-3 of channel 0, of channel 1, ...
    assert torch.equal(flat[:4], w[0, :4].long() + 128) and torch.equal(flat[4:8], w[1, :4].long() + 128)
    assert torch.equal(flat[64:68], w[0, 4:8].long() + 128)  # then K 4-7 of channel 0
    assert torch.equal(flat[16 * 12:16 * 12 + 4], w[16, :4].long() + 128)  # panel 1
    assert torch.equal(panel_linear.unpack_int8(packed), w)


@needs_int8
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40])
def test_int8_timing_kernel_sums_exactly(rows):
    w, a = _codes(48, 4864), _codes(rows, 4864)  # Qwen2.5-0.5B's down projection's K
    packed = panel_linear.pack_int8(w)
    ref = torch._int_mm(a, w.t()).float()
    assert torch.equal(panel_linear.timing_kernel(panel_linear.INT8)(a, packed), ref)
    assert torch.equal(ops.panel_int8_linear(a, packed), ref)


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


@needs_int8
def test_int8_projection_runs_the_kernel_inside_the_piece(tmp_path):
    def fn(a, w1, w2):  # the scaling, as the GEMM choice writes it after the op
        return ops.panel_int8_linear(a, w1) * 0.5, ops.panel_int8_linear(a, w2)

    w1, w2 = _codes(48, 64), _codes(32, 64)
    run, source = _library(fn, [_codes(5, 64), w1, w2], tmp_path)
    assert source.count("aoti_torch_cpu_kiln_panel_int8_linear(") == 3  # its definition and the two calls
    assert source.count("void kiln_panel_int8_gemm(") == 1 and "kiln_panel_gemm(" not in source
    packed = [panel_linear.pack_int8(w) for w in (w1, w2)]
    for rows in (1, 7, 16, 40):
        a = _codes(rows, 64)
        for out, ref in zip(run(a, *packed), fn(a, *packed)):
            assert torch.equal(out, ref)


@pytest.mark.parametrize("scheme", [None, pytest.param("int8", marks=needs_int8)])
def test_compiled_model_on_the_panel_gemm_decodes_like_eager(scheme, demo_dirs, tmp_path_factory, monkeypatch,
                                                             capsys):
    """The demo llama with every projection, its LM head and the head's greedy screen on the panel
    GEMMs (the choice's timings forced): the runtime packs the weights the manifest names, the pieces
    and the artifact's head and greedy screen libraries run the kernels in C++ (the ops' Python
    references and the screen's torch ops, patched to fail, are never called), and the tokens are eager's, with logprobs (the head's logits) and
    without (the screen's argmax)."""
    from kiln import LLM, SamplingParams
    from kiln.compiler import artifact
    from kiln.models import lm_head
    from kiln.passes import gemm_choice
    from tests.oracle import PROMPTS

    kernel = "panels8_int8_blocked" if scheme else "panels16"  # int8's projections: activations per block of 32
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_choice, "_streamed_time", lambda fn, args: 0.5 if fn.kernel.startswith("panels") else 2.0)
        mp.setattr(gemm_choice, "MIN_TIMED_ELEMENTS", 0)  # the demo's projections are time-worthy here
        compiled = LLM(demo_dirs["llama"], compile=True, cache_dir=tmp_path_factory.mktemp("panels"),
                       quantization=scheme)
    layers = compiled.model_config.num_layers
    manifest = artifact.read_manifest(compiled.artifact_path)
    for variant in manifest["variants"]:
        assert sorted(variant["weight_formats"].values()) == [kernel] * 4 * layers
    head = manifest["lm_head"]
    assert (head["format"], head["screen"], sorted(head["libraries"])) == \
        ("panels16", "panels16_int8", ["panels16", "panels16_int8"])
    assert sorted(manifest["libraries"]) == ["decode_attention", "greedy_screen"]  # the screen's kernel ships too
    assert artifact.verify(compiled.artifact_path) and all(
        (compiled.artifact_path / "blobs" / f"{e['sha256']}.so").stat().st_size == e["bytes"]
        for e in head["libraries"].values())
    path = compiled.artifact_path
    status, out = kiln_cache_cmd(capsys, "info", path.name, "--cache-dir", path.parent)
    assert status == 0 and "LM head    packed as panels16, greedy screen on panels16_int8, libraries panels16 " \
        f"{head['libraries']['panels16']['sha256'][:16]}" in out
    dump = tmp_path_factory.mktemp("dump") / "d"
    assert kiln_cache_cmd(capsys, "dump", path.name, "-o", dump, "--cache-dir", path.parent)[0] == 0
    for format, entry in head["libraries"].items():  # each library's C++, and who runs it
        folder = dump / "debug" / "inductor" / entry["sha256"][:16]
        assert (folder / "USERS").read_text() == f"LM head ({format})\n" and list(folder.glob("*.cpp"))
    fail = lambda w: pytest.fail("the reference op ran, not the kernel")  # noqa: E731
    monkeypatch.setattr(panel_linear, "unpack", fail)
    monkeypatch.setattr(panel_linear, "unpack_int8", fail)
    monkeypatch.setattr(panel_linear, "unpack_int8_blocked", fail)
    monkeypatch.setattr(lm_head.GreedyScreen, "_screen_logits", lambda self, h: fail(h))  # the screen's torch ops
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    got = compiled.generate(PROMPTS, params)
    eager = LLM(demo_dirs["llama"], quantization=scheme)
    ref = eager.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    screen = compiled.engine.runner.greedy_tokens.__self__
    assert screen.screen is None  # no greedy call so far: logprobs take the logits
    plain = compiled.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert screen.screen is not None and screen.screen.kernel == "panels16_int8" and screen.screen.fused is not None
    assert [o.token_ids for o in plain] == [o.token_ids for o in ref]
    # the load packed into a file in the cache; a later one maps it and packs nothing
    compiled.engine.runner.forward.pack_file.wait()
    assert [f.name for f in (path.parent / "packed").iterdir()] == [compiled.engine.runner.forward.pack_file.path.name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemms, "pack", lambda *args, **kwargs: pytest.fail("a load from the cache packed"))
        again = LLM(demo_dirs["llama"], require_artifact=True, cache_dir=path.parent, quantization=scheme)
    assert again.engine.runner.forward.pack_file.hit
    assert len(again.engine.runner.forward.pack_file.slots) == 4 * layers + 1  # the projections and the head
    assert again.engine.runner.forward.pack_file.slots == compiled.engine.runner.forward.pack_file.slots
    reloaded = again.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in reloaded] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        # int8: an activation code can round the other way after Inductor's RMSNorm (as in
        # test_quantization's test_int8_compiled_equals_int8_eager): a rare logprob moves by up to ~1e-2
        diff = (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs()
        assert (diff.max() < 2e-2 and diff.median() < 1e-4) if scheme else diff.max() < 1e-4, diff
    # an int8 head asked for at load runs on the same libraries: the head's panel GEMM, and its greedy tokens
    # from the screen's library in one call, the argmax of its logits (with logprobs, the logits path)
    head8 = LLM(demo_dirs["llama"], require_artifact=True, cache_dir=path.parent, quantization=scheme,
                lm_head_quantization="int8")
    assert head8.model.lm_head_kernel.kernel == "panels16_int8"
    assert head8.engine.runner.greedy_tokens == head8.model.lm_head_kernel.greedy
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_head.Int8Head, "__call__", lambda self, h: pytest.fail("greedy steps ran the logits"))
        one_call = head8.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in one_call] == [o.token_ids for o in head8.generate(PROMPTS, params)]
