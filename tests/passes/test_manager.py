"""The pipeline: order, the key, the user's passes, and docs/passes.md's worked example run as written."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

from kiln import KilnError
from kiln.compiler.key import cache_key, model_factors
from kiln.config import CompileConfig, PassConfig
from kiln.passes import GraphPass, PassManager, count_ops, load_pass
from kiln.passes.cleanup.dead_code import DeadCodeElimination
from kiln.passes.cleanup.noop_elimination import NoOpElimination
from tests.passes.conftest import fresh

DOC = Path(__file__).parents[2] / "docs" / "passes.md"
ops = torch.ops.kiln


def doc_example() -> str:
    """The `mypasses.py` code block of docs/passes.md."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "# mypasses.py" in b)
    return block


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_pipeline_order_and_switches():
    assert [p.name for p in PassManager().passes] == ["noop_elimination", "rms_quant", "allreduce_rms", "act_quant",
                                                      "rope_kvcache", "attn_quant", "lowering", "dead_code"]
    assert [p.name for p in PassManager(PassConfig(rms_quant=False, allreduce_rms=False)).passes] == \
        ["noop_elimination", "act_quant", "rope_kvcache", "attn_quant", "lowering", "dead_code"]


def test_key_follows_the_pass_configuration(quantized_llms):
    model = quantized_llms["int8"].model
    base = cache_key(model_factors(model, CompileConfig()))
    assert cache_key(model_factors(model, CompileConfig())) == base  # same config twice: same key
    off = {cache_key(model_factors(model, CompileConfig(passes=PassConfig(**{f: False}))))
           for f in ("noop_elimination", "allreduce_rms", "rms_quant", "act_quant", "rope_kvcache", "attn_quant",
                     "lowering")}
    assert len(off) == 7 and base not in off


def test_pipeline_counts_on_the_int8_demo(quantized_llms, traced_graphs):
    traced = fresh(traced_graphs["int8"])
    report = PassManager(PassConfig(gemm_choice=False)).run(traced.graph, (1, 2048))  # timings choose GEMMs
    assert report.matches["rms_quant"] == 8 and report.matches["act_quant"] == 4
    assert report.matches["rope_kvcache"] == 0  # CPU: the rotary and the write go to Inductor, apart
    assert report.matches["attn_quant"] == 0  # per-token quant of the attention output stays unfused
    # lowered: 8 fused norms + 4 fused activations + 4 o_proj input quants + the final norm + 4 rotaries
    # + 4 cache writes
    assert report.matches["lowering"] == 25
    kiln_ops = {str(n.target) for n in traced.graph.graph.nodes if str(n.target).startswith("kiln.")}
    assert kiln_ops == {"kiln.attention.default", "kiln.scaled_mm.default"}
    assert report.matches["allreduce_rms"] == 0  # one rank: no all_reduce to fuse
    assert list(report.matches) == ["noop_elimination", "rms_quant", "allreduce_rms", "act_quant", "rope_kvcache",
                                    "attn_quant", "lowering", "dead_code"]


def test_noop_elimination_drops_only_what_changes_nothing():
    def f(x):
        y = x.view(4, 8).reshape(4, 8)[:, 0:8]  # three no-ops
        return torch.ops.kiln.rms_norm(y.view(2, 16), torch.ones(16), 1e-6)  # a real reshape
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.randn(4, 8))
    x = torch.randn(4, 8)
    expected = gm(x)
    assert NoOpElimination()(gm.graph) == 3
    DeadCodeElimination()(gm.graph)
    gm.recompile()
    shape_ops = [n for n in gm.graph.nodes if n.op == "call_function" and "view" in str(n.target)]
    assert len(shape_ops) == 1
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)


def test_dead_code_keeps_the_cache_write():
    def f(k, v, cache, slots):
        ops.kv_cache_write(k, v, cache, slots)  # result unused: still a mutation
        unused = k * 2  # noqa: F841
        return v + 1
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.zeros(2, 2, 2, 1, 4), torch.tensor([0, 3]))
    assert DeadCodeElimination()(gm.graph) == 1
    assert count_ops(gm.graph, ops.kv_cache_write) == 1


def test_bad_pass_specs_are_refused():
    for spec, message in [("nocolon", "expected module:Name"), ("no_such_mod:X", "cannot import no_such_mod"),
                          ("json:nothing", "json has no 'nothing'"), ("json:dumps", "not a kiln.passes.GraphPass")]:
        with pytest.raises(KilnError, match=message):
            load_pass(spec)

    class Twin(GraphPass):
        name = "rms_quant"

    with pytest.raises(KilnError, match="two passes are named 'rms_quant'"):
        PassManager(custom=[Twin()])


def test_docs_example_compiles_counts_and_rekeys(demo_dirs, kiln_cache, tmp_path, quantized_llms):
    """docs/passes.md, run as a user would: the pass in their own module, `kiln compile --pass`."""
    (tmp_path / "mypasses.py").write_text(doc_example())
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "kiln", "compile", str(demo_dirs["llama"]), "--cache-dir",
                          str(kiln_cache), "--pass", "mypasses:InlineSiluMul", "-q"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^inline_silu_mul\s+4$", out.stdout, re.M), out.stdout
    assert re.search(r"^act_quant\s+0$", out.stdout, re.M)  # unquantized: nothing for act_quant

    from kiln import LLM, SamplingParams
    from tests.oracle import PROMPTS

    user_pass = import_file(tmp_path / "mypasses.py", "mypasses").InlineSiluMul()
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, passes=[user_pass], require_artifact=True)
    assert str(llm.artifact_path) == out.stdout.strip().splitlines()[-1]  # the CLI's artifact, found again
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    eager = quantized_llms[None].generate(PROMPTS, params)
    for got, want in zip(llm.generate(PROMPTS, params), eager):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)

    model = quantized_llms[None].model
    key = cache_key(model_factors(model, CompileConfig(), [user_pass]))
    assert key != cache_key(model_factors(model, CompileConfig()))
    (tmp_path / "mypasses2.py").write_text(doc_example().replace("x.chunk(2, dim=-1)", "x.split(x.shape[-1] // 2, -1)"))
    edited = import_file(tmp_path / "mypasses2.py", "mypasses2").InlineSiluMul()
    assert cache_key(model_factors(model, CompileConfig(), [edited])) != key  # edited code: new key


def test_custom_graph_pass_runs_in_order():
    seen = []

    class Probe(GraphPass):
        def __call__(self, graph: fx.Graph) -> int:
            seen.append(count_ops(graph, ops.silu_and_mul_quant))
            return 7

    def f(x):
        q, s = ops.quant_int8(ops.silu_and_mul(x), None)
        return q, s
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f)(torch.randn(3, 8))
    report = PassManager(custom=[Probe()]).run(gm, (1, 16))
    assert seen == [1] and report.matches["Probe"] == 7 and report.matches["act_quant"] == 1
    assert list(report.matches).index("Probe") < list(report.matches).index("lowering")  # user passes see kiln ops


def test_user_pass_returning_none_or_failing():
    """vLLM's passes return None: "matches unknown". A failing user pass is one line naming it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.passes.manager import UNKNOWN

    class Silent(GraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            pass

    class Broken(GraphPass):
        def __call__(self, graph: fx.Graph) -> int:
            return {}["missing"]

    class Wordy(GraphPass):
        def __call__(self, graph: fx.Graph):
            return "done"

    gm = make_fx(lambda x: ops.silu_and_mul(x))(torch.randn(3, 8))
    assert PassManager(custom=[Silent()]).run(gm, (1, 16)).matches["Silent"] == UNKNOWN
    with pytest.raises(KilnError, match=r"^user pass 'Broken' failed: KeyError: 'missing' \(run with -vv") as e:
        PassManager(custom=[Broken()]).run(gm, (1, 16))
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(KilnError, match="user pass 'Wordy' returned 'done'"):
        PassManager(custom=[Wordy()]).run(gm, (1, 16))


def test_pass_uuid_covers_configuration_and_needs_source():
    from kiln.passes.fusion.allreduce_rms import AllReduceRMSFusion

    assert AllReduceRMSFusion(2, 64).uuid() == AllReduceRMSFusion(2, 64).uuid()
    assert len({AllReduceRMSFusion(2, 64).uuid(), AllReduceRMSFusion(2, 128).uuid(), AllReduceRMSFusion(4, 64).uuid()}) == 3

    class Opaque(GraphPass):
        def __init__(self, table: object):
            self.table = table

    with pytest.raises(KilnError, match=r"pass 'Opaque': config\(\) gave .* override config\(\)"):
        Opaque(object()).uuid()
    code = ("from kiln.passes import GraphPass\nclass Inline(GraphPass):\n    pass\n"
            "from kiln import KilnError\ntry:\n    Inline().uuid()\nexcept KilnError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "cannot be read (defined in `python -c`" in out and "define it in a file" in out
