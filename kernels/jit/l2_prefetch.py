"""Asking for read-only memory ahead of use: ``prefetch.global.L2``, one per 128-byte line.

A kernel launched with programmatic dependent launch (kernels/pdl.py) starts while the grid
before it is still finishing, and must not touch what that grid writes before
`wait_for_previous_grid` returns. A model's weights are no grid's output: a kernel may ask for
them at once, so that they stream from HBM into L2 while the grid before it ends, and its main
loop after the wait finds them there. That turns the gap between two memory-bound kernels of a
batch-1 decode step (the kernel before draining its last wave, this one's first loads on their
way) into weight traffic. A prefetch returns nothing and changes no value: the kernel computes
the same bits with or without it. Prefetches past the end of an allocation are never issued
(the caller clamps its rows; `prefetch_rows_to_l2` clamps the columns).

Launched without PDL, the wait returns at once and the main loop's own loads follow the
prefetches immediately, so the wrappers ask for prefetching only where the launch uses PDL.
Under the Triton interpreter, which runs no PTX, `prefetch_to_l2` does nothing.
"""

import triton
import triton.language as tl

from kernels.jit.interpreter_compat import interpreter_enabled

if interpreter_enabled():

    @triton.jit
    def prefetch_to_l2(pointers):
        pass

else:

    @triton.jit
    def prefetch_to_l2(pointers):
        """Bring the line holding each address of `pointers` into L2 (no value comes back)."""
        tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", constraints="=r,l",
                                  args=[pointers], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows_to_l2(row_pointers, num_columns, LINE_ELEMENTS: tl.constexpr, LINES_PER_STEP: tl.constexpr):
    """Prefetch columns [0, num_columns) of each row: row_pointers [R, 1] point at the rows' first
    elements (every one inside the allocation), LINE_ELEMENTS elements fill a line
    (`kernels.pdl.line_elements`), LINES_PER_STEP lines of every row per step.

    Columns 0, LINE_ELEMENTS, 2 LINE_ELEMENTS, ... lie one line apart, so they meet every line of
    a row wherever it starts, once the walk runs one line past the last column; the columns past
    the end are clamped to the last column, so no address leaves the row."""
    for start in range(0, num_columns + LINE_ELEMENTS - 1, LINE_ELEMENTS * LINES_PER_STEP):
        columns = start + tl.arange(0, LINES_PER_STEP) * LINE_ELEMENTS
        columns = tl.minimum(columns, num_columns - 1)  # [LINES_PER_STEP]
        prefetch_to_l2(row_pointers + columns[None, :])  # [R, LINES_PER_STEP] addresses
