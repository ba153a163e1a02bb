"""Option value types shared by kiln's commands: each parses one kind of value, or says what it expected."""

import argparse


def at_least(low: int):
    """An integer >= `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 1.5, got {text!r}") from None


def positive(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def not_negative(text: str) -> float:
    value = _number(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def units(parse):
    """A value `parse` reads (`kiln.units`: "10G", "7d"), its ValueError shown as the option's error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _counts(text: str, what: str, example: str, unit: str = "") -> list[int]:
    """A comma-separated list of integers, each at least 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} like {example}, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be at least 1{unit}, got {text!r}")
    return values


def batch_sizes(text: str) -> list[int]:
    """A comma-separated list of batch sizes, each at least 1: "1,16"."""
    return _counts(text, "batch sizes", "1,16")


def depths(text: str) -> list[int]:
    """A comma-separated list of KV-cache depths in tokens, each at least 1: "32,2048,8192"."""
    return _counts(text, "depths", "32,2048", " token")
