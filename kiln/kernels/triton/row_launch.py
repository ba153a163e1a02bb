"""The launch shape of the kernels that give one program a whole row (the norms, SiLU*Mul)."""


def row_warps(block: int) -> int:
    """Warps for a program holding `block` values of a row: about 32 per thread, 4 to 16 warps. With
    a fixed 4, a Llama-70B MLP row (2 x 32768 values) needs too many registers a thread, and its fp8
    epilogue spills (`tests/kernels/test_triton_hopper.py` checks sm_90 builds)."""
    return min(max(block // 1024, 4), 16)
