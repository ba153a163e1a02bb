"""Packing at load releases the plain copy of each weight every variant reads packed: a compiled CPU
model holds its projections once, and the model itself refuses to run on what was released."""

import pytest
import torch

from kiln import LLM
from kiln.bench.decode import decode_weight_bytes
from kiln.compiler.contract import GraphInput, weight_indices
from kiln.runtime import bind
from kiln.weights.packing import RELEASED, pack_weights
from kiln.errors import KilnError
from kiln.kernels import packed_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

QKV, O = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"


def test_only_weights_every_variant_reads_packed_are_released(demo_dirs):
    model = LLM(demo_dirs["llama"]).model
    names = [name for name, _ in model.named_parameters()]
    inputs = [GraphInput("weight", name) for name in names]
    qkv, o = (model.get_parameter(n).detach().clone() for n in (QKV, O))
    weight_bytes = decode_weight_bytes(model)
    # variant 0 reads both packed; variant 1 reads o_proj plain (it is absent from its formats)
    packed = pack_weights(weight_indices(inputs), model, [{QKV: "onednn", O: "onednn"}, {QKV: "onednn"}], release=True)

    assert getattr(model, RELEASED) == {QKV: qkv.shape}
    assert model.get_parameter(QKV).numel() == 0 and model.get_parameter(QKV).dtype == qkv.dtype
    assert torch.equal(model.get_parameter(O), o)  # still read plain by variant 1
    x = torch.randn(3, qkv.shape[1])
    for variant in packed:  # the packed copy is the weight's own, not a view of the released memory
        torch.testing.assert_close(packed_linear.onednn_linear(x, variant[names.index(QKV)]), x @ qkv.t())
    assert decode_weight_bytes(model) == weight_bytes  # the floor still counts what a step reads
    with pytest.raises(KilnError, match="released once packed"):
        model(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [], None)


def test_a_released_model_is_not_bound_to_another_artifact(demo_dirs, llama_artifact):
    model = LLM(demo_dirs["llama"]).model
    inputs = [GraphInput("weight", name) for name, _ in model.named_parameters()]
    pack_weights(weight_indices(inputs), model, [{QKV: "onednn"}], release=True)
    with pytest.raises(KilnError, match=f"weight {QKV} of this model was released once packed"):
        bind.load(llama_artifact, model)


def test_without_release_the_model_keeps_every_weight(demo_dirs):
    model = LLM(demo_dirs["llama"]).model
    inputs = [GraphInput("weight", name) for name, _ in model.named_parameters()]
    pack_weights(weight_indices(inputs), model, [{QKV: "onednn"}])
    assert not hasattr(model, RELEASED) and model.get_parameter(QKV).numel() > 0
