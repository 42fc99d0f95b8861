"""Triton `@triton.jit` kernels, one module per op.

Only the Triton wrappers (`kernels.<op>.<op>_triton`) import these modules, and
they do it inside the wrapper, so importing `kernels` never imports triton.

Importing this package under the Triton interpreter (``TRITON_INTERPRET=1``)
also applies `interpreter_compat.patch_interpreter_bfloat16`, which makes the
interpreter's bfloat16 `tl.dot` and float32 -> bfloat16 rounding match a GPU,
`patch_interpreter_scalar_index` (loops with tensor bounds on older Triton) and
`patch_interpreter_fp8` (float32 -> float8 e4m3 rounding as on a GPU).
"""

from kernels.jit.interpreter_compat import (
    interpreter_enabled,
    patch_interpreter_bfloat16,
    patch_interpreter_fp8,
    patch_interpreter_scalar_index,
)

if interpreter_enabled():
    patch_interpreter_bfloat16()
    patch_interpreter_scalar_index()
    patch_interpreter_fp8()
