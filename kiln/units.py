"""Sizes and ages as people write them ("10G", "7d") and as tables show them."""

import re

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'10G' -> bytes (binary units, an optional trailing B or iB: 10G = 10GB = 10GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"expected a size like 500M or 10G, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def parse_age(text: str) -> float:
    """'7d' -> seconds (s, m, h, d, w)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not m:
        raise ValueError(f"expected an age like 12h, 7d or 2w, got {text!r}")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def format_size(n: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")
