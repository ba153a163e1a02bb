"""`kiln cache explain`: which key factors differ between two artifacts, or between a model and the
nearest artifact in the cache; the question a cache miss raises."""

from dataclasses import dataclass

ABSENT = object()
"""A factor one side does not have."""


@dataclass
class Difference:
    factor: str
    """Dotted path into the key factors, e.g. `compile.passes.rms_quant`."""
    a: object
    b: object
    meaning: str


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for k, v in value.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: value}


def _meaning(factor: str, a: object, b: object, labels: tuple[str, str]) -> str:
    head, _, rest = factor.partition(".")
    if head == "passes":
        if a is ABSENT or b is ABSENT:
            return f"pass {rest} runs for {labels[1] if a is ABSENT else labels[0]} only"
        return f"pass {rest} changed (its source or its settings: the uuid differs)"
    if head == "compile" and rest.startswith("passes."):
        return f"kiln's {rest.removeprefix('passes.')} pass on in one, off in the other (--disable-pass)"
    return {
        "dtype": "activation dtype",
        "quantization": "quantization scheme",
        "kiln_source": "kiln's own source (another kiln version, or an edited kernel, model or pass)",
        "torch": "torch version",
        "python": "Python version",
        "system": "the machine compiled for",
        "compile": "compile option",
        "model": "model shape or configuration",
    }.get(head, "key factor")


def differences(a: dict, b: dict, labels: tuple[str, str] = ("A", "B")) -> list[Difference]:
    """Every leaf of the key factors that differs between `a` and `b` (named `labels` in the
    explanations), in a stable order."""
    fa, fb = _flatten(a), _flatten(b)
    out = []
    for factor in sorted(fa.keys() | fb.keys()):
        va, vb = fa.get(factor, ABSENT), fb.get(factor, ABSENT)
        if va != vb:
            out.append(Difference(factor, va, vb, _meaning(factor, va, vb, labels)))
    return out


def show(value: object) -> str:
    """A factor's value for a table: absent as '-', long hashes shortened."""
    if value is ABSENT:
        return "-"
    text = str(value)
    return text[:12] + "…" if len(text) > 16 and all(c in "0123456789abcdef" for c in text) else text


def nearest(factors: dict, candidates: dict[str, dict]) -> str | None:
    """The candidate key whose factors differ from `factors` in the fewest places."""
    if not candidates:
        return None
    return min(candidates, key=lambda key: (len(differences(factors, candidates[key])), key))
