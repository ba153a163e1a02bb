"""Read the `quantization_config` of a compressed-tensors checkpoint (llm-compressor's output).

kiln runs the layouts its W8A8 `QuantLinear` can hold exactly: 8-bit symmetric int or fp8 (e4m3)
weights with one scale per output channel or per tensor, and 8-bit activations quantized per token
at run time or per tensor with a calibrated `input_scale`; and W4A16 `pack-quantized` checkpoints
(symmetric 4-bit int weights, a scale per group of input channels: what GPTQ/AWQ-style exports use),
whose weights `Int4Linear` holds exactly and whose activations it quantizes to int8 per token (W4A8).
Anything else is refused with its reason rather than run approximately.
"""

from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.kernels.quant import ACT_BLOCK

FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
SCHEME_OF_TYPE = {"int": "int8", "float": "fp8"}


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its decoder projections."""

    scheme: str  # "int8" | "fp8"
    static_input: bool  # activations: per-tensor `input_scale` from the checkpoint, else per token
    weight_per_tensor: bool  # one `weight_scale` per projection, else one per output channel
    group_size: int | None = None  # int4: input channels a weight scale covers


def _fail(problem: str) -> KilnError:
    return KilnError(f"unsupported compressed-tensors checkpoint: {problem}; kiln loads W8A8 int8/fp8 "
                     "checkpoints (symmetric, per-channel or per-tensor weights, per-token or per-tensor "
                     "activations) and W4A16 pack-quantized ones (symmetric int4 weights in groups)")


def _args(group: dict, key: str) -> dict:
    args = group.get(key)
    if not args:
        raise _fail(f"config group has no {key!r}" + (" (weight-only quantization)" if key != "weights" else ""))
    if args.get("num_bits") != 8 or args.get("type") not in SCHEME_OF_TYPE:
        raise _fail(f"{key} are {args.get('num_bits')}-bit {args.get('type')}")
    if not args.get("symmetric", True):
        raise _fail(f"{key} are asymmetric (zero points)")
    return args


def parse_quantization_config(qc: dict) -> CheckpointQuantization | None:
    """`quantization_config` from config.json -> what the loader and model need; None if absent."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise KilnError(f"quantization_config.quant_method {method!r} is not supported: kiln loads "
                        "compressed-tensors checkpoints, or quantizes full-precision ones with --quantization")
    if qc.get("format") not in FORMATS:
        raise _fail(f"format {qc.get('format')!r}")
    if qc.get("kv_cache_scheme"):
        raise _fail("a quantized KV cache (kv_cache_scheme)")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _fail("no config_groups")
    if any(g != groups[0] for g in groups[1:]):
        raise _fail("config groups that quantize layers differently")
    group = groups[0]
    if "Linear" not in (group.get("targets") or []):
        raise _fail(f"targets {group.get('targets')} (kiln needs every Linear quantized alike)")
    for entry in qc.get("ignore") or []:
        if "lm_head" not in entry:
            raise _fail(f"ignore entry {entry!r} (only the LM head may stay unquantized)")
    if group.get("output_activations"):
        raise _fail("quantized output activations")
    if (group.get("weights") or {}).get("num_bits") == 4:
        return _int4(qc, group)
    if qc.get("format") == "pack-quantized":
        raise _fail("pack-quantized weights of other than 4 bits")
    weights, inputs = _args(group, "weights"), _args(group, "input_activations")
    if weights["type"] != inputs["type"]:
        raise _fail(f"{weights['type']} weights with {inputs['type']} activations")
    if weights.get("dynamic", False) or weights.get("strategy") not in ("channel", "tensor"):
        raise _fail(f"weight strategy {weights.get('strategy')!r}" + (" (dynamic)" if weights.get("dynamic") else ""))
    static = (inputs.get("strategy"), bool(inputs.get("dynamic", False)))
    if static not in (("token", True), ("tensor", False)):
        raise _fail(f"activation strategy {inputs.get('strategy')!r} with dynamic={static[1]}")
    return CheckpointQuantization(
        scheme=SCHEME_OF_TYPE[weights["type"]],
        static_input=static == ("tensor", False),
        weight_per_tensor=weights["strategy"] == "tensor",
    )


def _int4(qc: dict, group: dict) -> CheckpointQuantization:
    """A W4A16 checkpoint: 4-bit symmetric int weights packed eight to an int32, a scale per group."""
    weights = group["weights"]
    if qc.get("format") != "pack-quantized":
        raise _fail(f"4-bit weights in format {qc.get('format')!r} (kiln reads pack-quantized)")
    if weights.get("type") != "int" or not weights.get("symmetric", True):
        raise _fail(f"4-bit {weights.get('type')} weights" + ("" if weights.get("symmetric", True) else
                                                                 " with zero points (asymmetric)"))
    if group.get("input_activations"):
        raise _fail("4-bit weights with quantized activations (kiln reads W4A16)")
    if weights.get("strategy") != "group" or weights.get("dynamic", False):
        raise _fail(f"4-bit weight strategy {weights.get('strategy')!r} (kiln reads group)")
    if weights.get("actorder"):
        raise _fail(f"actorder {weights.get('actorder')!r} (group indices, weight_g_idx)")
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0 or size % ACT_BLOCK:
        raise _fail(f"group_size {size!r} (kiln needs a multiple of {ACT_BLOCK}: its activations take a scale per "
                    f"{ACT_BLOCK})")
    return CheckpointQuantization(scheme="int4", static_input=False, weight_per_tensor=False, group_size=size)
