"""The opt-in int8 LM head: its logits track full precision's, its greedy tokens mostly agree, and it is
what both the eager and the compiled paths run once asked for. The packed fp32 head's greedy screen:
the fp32 argmax from int8 logits, or no answer."""

import pytest
import torch

from kiln import LLM, KilnError, SamplingParams
from kiln.compiler import artifact
from kiln.kernels import packed_linear, panel_linear, quantize_weight
from kiln.kernels.quant import ACT_BLOCK, int8_block_mm, quant_int8_blocked
from kiln.models.lm_head import GreedyScreen, Int8Head, PackedHead
from tests.oracle import PROMPTS

ops = torch.ops.kiln
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)


def test_int8_head_tracks_full_precision(demo_dirs):
    full = LLM(demo_dirs["llama"])
    int8 = LLM(demo_dirs["llama"], lm_head_quantization="int8")
    assert isinstance(int8.model.lm_head_kernel, Int8Head) and full.model.lm_head_kernel is None
    hidden = torch.randn(5, full.model_config.hidden_size)
    ref, got = full.model.compute_logits(hidden), int8.model.compute_logits(hidden)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.02
    a, b = full.generate(PROMPTS, GREEDY), int8.generate(PROMPTS, GREEDY)
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids))
    assert same / sum(len(p.token_ids) for p in a) >= 0.75  # the trained demo: near ties decide the rest


def test_compiled_program_keeps_the_int8_head(demo_dirs, kiln_cache):
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, lm_head_quantization="int8")
    eager = LLM(demo_dirs["llama"], lm_head_quantization="int8")
    hidden = torch.randn(3, llm.model_config.hidden_size)
    manifest = artifact.read_manifest(llm.artifact_path)
    if "panels8_int8_blocked" in artifact.lm_head_libraries(manifest):
        # an AVX2 CPU: the artifact's blocked int8 GEMM runs the head, activations per token and block of 32
        # as the projections' (eager runs it per token, on torch's or oneDNN's int8 GEMM)
        head = llm.model.lm_head_kernel
        assert head.kernel == "panels8_int8_blocked" and not head.screens
        plain = panel_linear.unpack_int8_blocked(head.codes)
        assert torch.equal(plain, quantize_weight(llm.model.lm_head_weight(), torch.int8)[0])
        a, a_scale = quant_int8_blocked(hidden, ACT_BLOCK)
        want = int8_block_mm(a, a_scale, plain, head.scale, torch.float32)
        torch.testing.assert_close(llm.engine.runner.compute_logits(hidden), want, rtol=1e-5, atol=1e-5)
        return
    # the artifact may ask for a packed fp32 head; the int8 head asked for wins, on the artifact's int8
    # panel GEMM where it ships one: the same integer sums, the same logits
    torch.testing.assert_close(llm.engine.runner.compute_logits(hidden), eager.model.compute_logits(hidden))
    shipped = "panels16_int8" in artifact.lm_head_libraries(manifest)
    assert (llm.model.lm_head_kernel.kernel == "panels16_int8") == shipped
    # greedy steps take the head's argmax from the greedy screen's library exactly where the artifact ships
    # it (the demo's head is too small to pack; tests/kernels/test_cpp_lowering.py forces the libraries)
    one_kernel = shipped and "greedy_screen" in manifest.get("libraries", {})
    assert (llm.engine.runner.greedy_tokens == llm.model.lm_head_kernel.greedy) == one_kernel
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)  # greedy steps, with and without logprobs
    assert [o.token_ids for o in llm.generate(PROMPTS, plain)] == [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_unknown_head_quantization_is_refused(demo_dirs):
    with pytest.raises(KilnError, match="unknown LM head quantization 'int4'; choose from int8"):
        LLM(demo_dirs["llama"], lm_head_quantization="int4")


def near_tied_head(vocab: int = 1280, hidden: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A head and 5 hidden states, each with 24 rows of logits 1e-4 apart (fp32 tells them apart, bf16
    rounding, independent per row, reorders them), the first state's best row with a twin at a lower
    index (a tie that the first index wins)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    states = torch.randn(5, hidden, generator=g)
    groups = torch.randperm(vocab, generator=g)[:5 * 24].view(5, 24)
    for h, rows in zip(states, groups):
        u = h / h.norm()
        w = torch.randn(24, hidden, generator=g)
        weight[rows] = w + (3 + 1e-4 * torch.arange(24.0) / h.norm() - w @ u)[:, None] * u
    best = (states[0] @ weight.t()).argmax()
    twin = min(set(range(vocab)) - set(groups.flatten().tolist()))
    weight[twin] = weight[best].clone()
    return weight, states


def screen_kernels() -> list:
    kernels = [pytest.param("onednn_int8", marks=pytest.mark.skipif(
        not packed_linear.int8_gemm_exact(), reason="oneDNN's int8 GEMM is not exact on this CPU (no VNNI)"))]
    kernels.append(pytest.param("panels16_int8", marks=pytest.mark.skipif(
        panel_linear.available((64, 64), torch.int8) is not None, reason="no int8 panel GEMM on this CPU")))
    return kernels + [pytest.param("fbgemm_w7a8", marks=pytest.mark.skipif(
        not packed_linear.fbgemm_available(), reason="this torch has no fbgemm"))]


def panel_gemm(kernel: str):
    """The panel GEMM as the artifact's library runs it (here, built alone for timing), or None."""
    panel = {"panels16": panel_linear.FLOAT, "panels16_int8": panel_linear.INT8}.get(kernel)
    return panel_linear.timing_kernel(panel) if panel is not None else None


@pytest.mark.parametrize("kernel", screen_kernels())
@pytest.mark.parametrize("vocab", [1280, 1000])  # in blocks of 128, and not
@pytest.mark.parametrize("pack_rows", [32768, 384])  # packed whole, and in blocks
def test_greedy_screen_picks_the_fp32_argmax(kernel, vocab, pack_rows, monkeypatch):
    from kiln.models import lm_head

    monkeypatch.setattr(lm_head, "SCREEN_PACK_ROWS", pack_rows)
    monkeypatch.setattr(lm_head, "screen_kernel", lambda: kernel)
    weight, hidden = near_tied_head(vocab)
    ref = (hidden @ weight.t()).argmax(-1)
    if kernel == "panels16_int8" and vocab % 16:
        with pytest.raises(KilnError, match="a vocabulary of 1000 is not whole panels of 16 rows"):
            GreedyScreen(weight, kernel, panel_gemm(kernel))
        return
    head = PackedHead(weight, screen=True, screen_gemm=panel_gemm(kernel))
    assert head.screen is None and head.pending_bytes == vocab * (64 + 4) + min(vocab, pack_rows) * 64  # on use
    got = head.greedy(hidden)
    blocks = 1 if kernel == "panels16_int8" else -(-vocab // pack_rows)  # the panels' blocks are packed as one
    assert head.pending_bytes == 0 and len(head.screen.blocks) == blocks
    assert head.screen.kernel == kernel
    int8 = head.screen._logits(ops.quant_int8(hidden, None)[0])
    assert (int8.gather(1, ref[:, None]).squeeze(1) < int8.amax(-1)).any()  # int8 alone picks other tokens
    assert torch.equal(got, ref)
    assert torch.equal(head.greedy(hidden[:1]), ref[:1])


@pytest.mark.parametrize("kernel", screen_kernels())
def test_greedy_screen_matches_fp32_on_a_wide_random_head(kernel):
    """Random logits, the screen's worst case (no token far ahead), at a width where the int8 bound is
    loosest relative to the true error: still the fp32 argmax, from few candidates."""
    g = torch.Generator().manual_seed(2)
    weight, hidden = torch.randn(8192, 896, generator=g) * 0.02, torch.randn(16, 896, generator=g)
    hidden[3] *= 1e-3  # scale-free: a small hidden state bounds its logits as tightly
    hidden[5, 7] = 40.0  # one outlier channel: a coarse activation scale, a wider bound
    screen = GreedyScreen(weight, kernel, panel_gemm(kernel))
    vecdot = []
    real = torch.linalg.vecdot
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.linalg, "vecdot", lambda a, b: vecdot.append(len(a)) or real(a, b))
        got = screen(hidden)
    assert torch.equal(got, (hidden @ weight.t()).argmax(-1))
    assert vecdot[0] == 16 and vecdot[1] < 16 * 32  # the leaders, then the candidates: under 0.5% of the head


@pytest.mark.skipif(panel_linear.available((64, 64), torch.float32) is not None, reason="no panel GEMM on this CPU")
def test_head_on_the_panel_gemm_gives_the_logits():
    weight, hidden = near_tied_head()
    head = PackedHead(weight, "panels16", screen=False, gemm=panel_gemm("panels16"))
    assert torch.equal(panel_linear.unpack(head.weight), weight)  # packed in panels for the library
    torch.testing.assert_close(head(hidden), hidden @ weight.t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(KilnError, match="an LM head packed as 'panels16' runs on a panel GEMM library"):
        PackedHead(weight, "panels16")
    with pytest.raises(KilnError, match="a greedy screen on 'onednn_int8' runs on no panel GEMM library"):
        GreedyScreen(weight, "onednn_int8", panel_gemm("panels16_int8"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.skipif(panel_linear.available((64, 64), torch.int8) is not None, reason="no int8 panel GEMM on this CPU")
def test_int8_head_moves_onto_the_panel_gemm():
    """The artifact's int8 panel GEMM runs an int8 head with the same integer sums as its own GEMM:
    the same logits, from codes quantized once. A head of rows that fill no panels stays as it was."""
    weight, hidden = near_tied_head()
    head, own = Int8Head(weight, pack=False), Int8Head(weight)
    assert head.run_on_panels(panel_gemm("panels16_int8")) and head.kernel == "panels16_int8"
    assert torch.equal(panel_linear.unpack_int8(head.codes), quantize_weight(weight, torch.int8)[0])
    torch.testing.assert_close(head(hidden), own(hidden), rtol=1e-6, atol=1e-6)
    assert torch.equal(head(hidden).argmax(-1), own(hidden).argmax(-1))
    assert not own.run_on_panels(panel_gemm("panels16_int8")) and own.kernel != "panels16_int8"  # packed already
    # loading an artifact that ships the library moves the model's int8 head onto it, else packs it as usual
    from kiln.weights.packing import pack_lm_head

    gemm = panel_gemm("panels16_int8")
    for libraries, kernel in (({"panels16_int8": lambda x, w: [gemm(x, w)]}, "panels16_int8"), ({}, own.kernel)):
        model = torch.nn.Module()
        model.lm_head_kernel, model.lm_head_weight = Int8Head(weight, pack=False), lambda: weight
        assert pack_lm_head(model, {"format": "panels16"}, libraries) is None
        assert model.lm_head_kernel.packed and model.lm_head_kernel.kernel == kernel
        torch.testing.assert_close(model.lm_head_kernel(hidden), own(hidden), rtol=1e-6, atol=1e-6)
    odd = Int8Head(weight[:1000], pack=False)
    kernel, codes = odd.kernel, odd.codes
    assert not odd.run_on_panels(panel_gemm("panels16_int8"))
    assert odd.kernel == kernel and odd.codes is codes and not odd.packed


def test_greedy_screen_gives_up_where_it_cannot_tell():
    weight, hidden = near_tied_head()
    head = PackedHead(weight, screen=True)
    if not head.screens:
        pytest.skip("no exact int8 GEMM on this CPU")
    assert head.greedy(torch.zeros(2, 64)) is None  # every logit ties: more candidates than the cap
    nan = hidden.clone()
    nan[1, 3] = float("nan")
    assert head.greedy(nan) is None
    inf = hidden.clone()
    inf[0, 0] = float("inf")
    assert head.greedy(inf) is None
    assert PackedHead(weight, screen=False).greedy(hidden) is None


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_compiled_greedy_decoding_runs_on_the_screen(demo_dirs, packed_artifact, monkeypatch):
    """An artifact whose LM head is packed picks greedy tokens through the screen (on fbgemm here, the
    kernel of CPUs without VNNI), the tokens of the fp32 logits; a request that wants logprobs gets the
    logits."""
    from kiln.models import lm_head

    options = dict(compile=True, require_artifact=True, cache_dir=packed_artifact.parent, quantization="w7a8")
    monkeypatch.setattr(lm_head, "screen_kernel", lambda: None)
    logits = LLM(demo_dirs["llama"], **options)
    assert logits.engine.runner.greedy_tokens is None
    monkeypatch.setattr(lm_head, "screen_kernel", lambda: "fbgemm_w7a8")
    calls = []
    screen = lm_head.GreedyScreen.__call__
    monkeypatch.setattr(lm_head.GreedyScreen, "__call__", lambda self, h: calls.append(len(h)) or screen(self, h))
    llm = LLM(demo_dirs["llama"], **options)
    vocab, hidden = llm.model.lm_head_weight().shape
    pack_rows = min(vocab, lm_head.SCREEN_PACK_ROWS)
    assert llm.engine.runner.forward.reserved_bytes == vocab * (hidden + 4) + pack_rows * hidden
    head = llm.engine.runner.greedy_tokens.__self__
    sampled = SamplingParams(max_tokens=3, temperature=1.0, seed=0)
    chunked = LLM(demo_dirs["llama"], max_num_batched_tokens=8, **options)  # prefill chunks sample no row
    chunked.generate(PROMPTS[2:3], sampled)
    assert chunked.engine.runner.greedy_tokens.__self__.screen is None and not calls  # sampling never builds it
    assert head.screen is None
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got, ref = llm.generate(PROMPTS, plain), logits.generate(PROMPTS, plain)
    assert head.screen is not None and head.pending_bytes == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert max(calls) == len(PROMPTS) and sum(calls) == 12 * len(PROMPTS)  # every token, batched
    calls.clear()
    logprobs = llm.generate(PROMPTS, GREEDY)
    assert not calls and all(p is not None for o in logprobs for p in o.logprobs)
    assert [o.token_ids[:12] for o in logprobs] == [o.token_ids for o in ref]
