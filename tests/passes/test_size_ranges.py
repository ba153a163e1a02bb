"""Per-size-range gating: a pass that applies to small batches only shapes its own program variant,
and the loaded artifact routes each batch to the variant serving its token count."""

import pytest
import torch
from torch import fx

from kiln import LLM, KilnError
from kiln.cli import _print_matches
from kiln.compiler.artifact import pass_matches, read_manifest
from kiln.compiler.counters import counters
from kiln.config import CompileConfig, PassConfig
from kiln.kernels import AttentionMetadata
from kiln.passes import GraphPass, PassManager
from kiln.runtime.kv_cache import allocate_kv_caches


class DoubleOutput(GraphPass):
    """Doubles the backbone's output, for batches of up to 16 tokens: a change the test can see."""

    name = "double_output"

    def applies_to(self, size_range: tuple[int, int]) -> bool:
        return size_range[1] <= 16

    def __call__(self, graph: fx.Graph) -> int:
        output = next(n for n in graph.nodes if n.op == "output")
        value = output.args[0]
        hidden = value[0] if isinstance(value, (tuple, list)) else value
        with graph.inserting_before(output):
            doubled = graph.call_function(torch.ops.aten.mul.Tensor, (hidden, 2.0))
        doubled.meta["val"] = hidden.meta["val"]
        output.args = ((doubled, *value[1:]),) if isinstance(value, (tuple, list)) else (doubled,)
        return 1


def test_ranges_group_by_the_passes_that_apply():
    manager = PassManager(PassConfig(), [DoubleOutput()])
    config = CompileConfig(max_num_tokens=64, range_splits=(8, 32), sizes=(16, 48))
    assert config.dynamic_ranges() == [(1, 8), (9, 32), (33, 64)]
    units = [*config.dynamic_ranges(), (16, 16), (48, 48)]
    assert manager.group(units) == [[(1, 8), (16, 16)], [(9, 32), (33, 64), (48, 48)]]
    assert PassManager().group(units) == [units]  # kiln's own passes apply everywhere: one graph
    with pytest.raises(KilnError, match="range splits"):
        CompileConfig(max_num_tokens=64, range_splits=(64,))


def _prefill(llm: LLM, n: int):
    """One sequence prefilling `n` tokens into a fresh cache."""
    blocks = -(-n // 16)
    caches = allocate_kv_caches(llm.model_config, blocks, 16, torch.float32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None])
    ids = torch.randint(0, llm.model_config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    return ids, torch.arange(n), caches, meta


@torch.inference_mode()
def test_each_batch_runs_the_variant_for_its_token_count(demo_dirs, tmp_path, capsys):
    config = CompileConfig(max_num_tokens=64, range_splits=(8,), sizes=(16,))
    counters.clear()
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=tmp_path, compile_config=config, passes=[DoubleOutput()],
              max_num_batched_tokens=64)
    # variant 0 (1-8 and 16, with the pass): 3 unique pieces x (dynamic + size 16); variant 1 (9-32, 33-64):
    # the two pieces the pass does not touch are the same graphs, only the last one compiles again
    # (and the decode attention's library)
    assert counters["pieces_compiled"] + counters["pieces_cached"] == 7 and counters["blobs_saved"] == 7 + 1
    manifest = read_manifest(llm.artifact_path)
    assert [(v["ranges"], v["sizes"]) for v in manifest["variants"]] == [([[1, 8]], [16]), ([[9, 32], [33, 64]], [])]
    matches = pass_matches(manifest)
    assert matches["1-8,16"]["double_output"] == 1 and matches["9-64"]["double_output"] is None
    assert matches["1-8,16"]["lowering"] == matches["9-64"]["lowering"] == 9 + 4 + 4 + 4  # norms, activations, rotaries, writes

    for n in (1, 4, 8, 9, 12, 16, 17, 64):
        args = _prefill(llm, n)
        want = llm.model(*_prefill(llm, n))
        got = llm.engine.runner.forward(*args)
        factor = 2.0 if n <= 8 or n == 16 else 1.0
        torch.testing.assert_close(got, factor * want, atol=1e-4, rtol=1e-4, msg=f"{n} tokens")
    with pytest.raises(KilnError, match="65 tokens is larger than the artifact's max_num_tokens"):
        llm.engine.runner.forward(*_prefill(llm, 65))

    _print_matches(matches)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pass", "tokens", "1-8,16", "tokens", "9-64"]
    assert "double_output 1 -".split() == lines[-3].split()
