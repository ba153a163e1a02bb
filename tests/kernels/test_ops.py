"""Every kiln op passes torch.library.opcheck: schema, fake impl and registration agree."""

import pytest
import torch
from torch.library import opcheck

import kiln.kernels  # noqa: F401
from kiln.kernels import gemms

ops = torch.ops.kiln


def _attention_args():
    torch.manual_seed(0)
    kv = torch.randn(2, 6, 4, 2, 8)
    q = torch.randn(5, 4, 8)
    return (
        q, kv, kv.new_empty(0), torch.tensor([0, 3, 4, 5], dtype=torch.int32),
        torch.tensor([3, 6, 1], dtype=torch.int32), torch.tensor([[0, 0], [1, 2], [3, 0]], dtype=torch.int32),
        0.35, 0,
    )


CASES = {
    "rms_norm": (ops.rms_norm, lambda: (torch.randn(3, 16), torch.randn(16), 1e-6)),
    "fused_add_rms_norm": (ops.fused_add_rms_norm, lambda: (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6)),
    "silu_and_mul": (ops.silu_and_mul, lambda: (torch.randn(3, 32),)),
    "rotary_embedding": (
        ops.rotary_embedding,
        lambda: (torch.tensor([0, 5, 2]), torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(16, 8), True),
    ),
    "kv_cache_write": (
        ops.kv_cache_write,
        lambda: (torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.zeros(2, 4, 4, 2, 8), torch.tensor([0, 7, -1])),
    ),
    "attention": (ops.attention, _attention_args),
}


@pytest.mark.parametrize("name", CASES)
def test_opcheck(name):
    op, make_args = CASES[name]
    opcheck(op.default, make_args(), test_utils=("test_schema", "test_faketensor"))


def test_calling_an_op_does_not_import_dynamo():
    """torch's custom ops import torch._dynamo on their first call (about a second): not kiln's, so
    the first request of a served artifact does not pay it."""
    import subprocess
    import sys

    code = ("import sys, torch, kiln.kernels\n"
            "x = torch.randn(3, 8)\n"
            "torch.ops.kiln.rms_norm(x, torch.ones(8), 1e-6)\n"
            "torch.ops.kiln.quant_int8(x, None)\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


@pytest.mark.parametrize("name", CASES)
def test_cpu_calls_go_straight_to_the_ops_function(name, monkeypatch):
    """On CPU the dispatcher calls each op's function directly, not through torch's custom-op
    wrapper (its checks run on every call, ~150 calls a decode step): the wrapper is made to fail,
    and the op still gives its function's numbers."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS[f"kiln::{name}"]
    monkeypatch.setitem(opdef._backend_fns, None, lambda *a, **k: pytest.fail("went through the wrapper"))
    op, make_args = CASES[name]
    args = make_args()
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out, ref = op(*args), opdef._init_fn(*ref_args)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(args, ref_args)  # the same mutation (the KV-cache write)


@pytest.mark.parametrize("name,fmt", [("onednn_linear", "onednn"), ("onednn_int8_linear", "onednn_int8")])
def test_calls_on_packed_weights_go_straight_to_the_ops_function(name, fmt, monkeypatch):
    """A packed oneDNN weight makes the call dispatch on MkldnnCPU, not CPU: that key calls the
    function directly too (before, such calls fell through to the wrapper)."""
    from torch._library.custom_ops import OPDEFS

    from kiln.kernels import packed_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN")
    opdef = OPDEFS[f"kiln::{name}"]
    monkeypatch.setitem(opdef._backend_fns, None, lambda *a, **k: pytest.fail("went through the wrapper"))
    if fmt == "onednn":
        weight, x = torch.randn(24, 32), torch.randn(3, 32)
    else:
        weight = torch.randint(-127, 128, (24, 32), dtype=torch.int8)
        x = torch.randint(1, 256, (3, 32), dtype=torch.uint8)
    packed = gemms.pack(fmt, weight)
    assert packed_linear.is_packed(packed)
    torch.testing.assert_close(getattr(ops, name)(x, packed), opdef._init_fn(x, weight))
