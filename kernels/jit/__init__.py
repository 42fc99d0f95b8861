"""Triton `@triton.jit` kernels, one module per op.

Only the Triton wrappers (`kernels.<op>.<op>_triton`) import these modules, and
they do it inside the wrapper, so importing `kernels` never imports triton.

Importing this package under the Triton interpreter (``TRITON_INTERPRET=1``)
also applies `interpreter_compat.patch_interpreter_bfloat16`, which makes the
interpreter's bfloat16 `tl.dot` and float32 -> bfloat16 rounding match a GPU,
`patch_interpreter_scalar_index` (loops with tensor bounds on older Triton) and
`patch_interpreter_fp8` (float32 -> float8 e4m3 rounding as on a GPU).

Step-sized arguments. Triton compiles a kernel once per specialization of its arguments: an
integer equal to 1 becomes a constant, one divisible by 16 says so, and so does a pointer
aligned to 16 bytes. An argument that takes a new value every engine step (a step's token,
row or pair count, a count of chunks or splits, the stride of a [3, T] positions tensor)
would then compile new variants in the middle of serving whenever a step falls in a class
the warm-up did not run (an odd token count with an even pair count, say), a stall of
a second or more each on a GPU. Those parameters are listed in their kernel's
``@triton.jit(do_not_specialize=[...])``: one variant serves every value. They are counts
and strides of small index tensors, where the sm_90 compile (`tests/kernels/sm90_compile.py`)
is the same without the hints (a shorter loop in `route_topk_align` at T=1, 16 more registers
in `moe_offsets` at T=4096, no spill). The GEMMs' and norms' row counts keep theirs
(`fp8_linear`, `skinny_linear`, `add_rms_norm_router`, and the scatter of `moe_align`): there
a row count of 1 or a multiple of 16 compiles a shorter main loop (at T=1 `skinny_linear`
spilled without it), and the warm-up runs both classes of every token bucket. The strides
of the large tiles (a model's widths) keep theirs too. Block tables are padded to whole 16s
of columns instead (`vlm_catalog/engine/block_table_rows.py`), since the decode loop loads
its block ids as vectors. `tests/engine/test_warmup_variants.py` runs the engine with every launch recorded
and requires the benchmark's run to launch no variant its warm-up did not.
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
