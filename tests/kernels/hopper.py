"""Compiling kiln's Triton kernels for an H100 (sm_90) on a machine without one: Triton's NVIDIA
backend builds a cubin with the ptxas its wheel carries. Import only after
`pytest.importorskip("triton.backends.nvidia")`; `skip_without_ptxas()` skips a module where
Triton has no ptxas."""

import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # an H100 block's dynamic shared memory
LAUNCH_OPTIONS = {"num_warps", "num_stages"}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv"}


def compile_for_hopper(kernel, args: tuple, constexprs: dict):
    """Compile `kernel` for sm_90 as its launch would (`constexprs` may hold num_warps and
    num_stages), marking what the JIT marks 16-divisible (pointers, and ints it specializes whose
    value is a multiple of 16)."""
    constexprs = dict(constexprs)
    names = [p.name for p in kernel.params if not p.is_constexpr]
    unspecialized = set(kernel.do_not_specialize)
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0 and name not in unspecialized:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    options = {k: constexprs.pop(k) for k in LAUNCH_OPTIONS & constexprs.keys()}
    signature |= {name: "constexpr" for name in constexprs}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=HOPPER, options=options)


def skip_without_ptxas() -> None:
    try:
        found = Path(triton.knobs.nvidia.ptxas.path).is_file()
    except Exception:  # Triton raises when it finds no ptxas at all
        found = False
    if not found:
        pytest.skip("Triton has no ptxas here to compile for sm_90", allow_module_level=True)


def spilled_bytes(kernel) -> int:
    """Bytes of registers the sm_90 build spills to the stack and local memory (from cuobjdump,
    which Triton's wheel carries beside ptxas): a spilling kernel runs far slower."""
    cuobjdump = Path(triton.knobs.nvidia.ptxas.path).with_name("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    usage = dict(field.split(":", 1) for line in out.splitlines() if "REG:" in line for field in line.split())
    return int(usage["STACK"]) + int(usage["LOCAL"])
