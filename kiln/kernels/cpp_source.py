"""The C++ of kiln's kernels, kept as files in `kiln/kernels/csrc` and shipped as package data.

A kernel's source is compiled in two places: spliced into the wrapper AOTInductor generates for a piece
or a library (`kiln.kernels.cpp_lowering`), and alone, to time it (`panel_linear.timing_kernel`).
Neither has `csrc` on an include path, so `read` splices each `#include "file"` of csrc in itself: what
either compiler gets is one translation unit. A header that may land twice in one wrapper (two kernels'
sources spliced side by side) keeps itself once with an include guard.
"""

import functools
import re
from importlib import resources

_LOCAL_INCLUDE = re.compile(r'^#include "([^"]+)".*$', re.MULTILINE)


@functools.cache
def read(name: str) -> str:
    """The text of csrc/`name`, each `#include "other"` line replaced by csrc/other's text read the same way."""
    text = (resources.files(__package__) / "csrc" / name).read_text(encoding="utf-8")
    return _LOCAL_INCLUDE.sub(lambda match: read(match.group(1)).rstrip("\n"), text)
