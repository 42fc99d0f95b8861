"""The device side of programmatic dependent launch (kernels/pdl.py).

Every Triton kernel begins with `after_previous_grid()` or `wait_for_previous_grid()`, before
it reads or writes any memory (the one exception: a few kernels ask for their weights, which
no grid writes, into L2 first; kernels/jit/l2_prefetch.py): it waits until the grid before it in the stream has finished and
its writes are visible (``griddepcontrol.wait``). Then it lets the next grid launch
(``griddepcontrol.launch_dependents``; that grid waits the same way before its own work):
`after_previous_grid` at once, the kernels of the batch-1 decode step later, with
`let_next_grid_launch()` after their main loop. Where is a matter of speed, not of
correctness: the next grid's programs still wait for this whole grid. The next grid launches
once every program of this one has triggered or returned (the PTX ISA), so an early trigger
cannot take SMs from this grid's programs still to start; its waiting programs do start
their weight prefetches (kernels/jit/l2_prefetch.py) while this grid's main loop still
streams its own weights. On the H100 and H200 of 2026-11-27 the decode step with every
kernel triggering at its start was slower with PDL than without (4.51 against 4.14 ms), with
three cuBLAS GEMMs per layer breaking the chain; which of the two cost the time was not
measured. Triggered after the main loop, the next launch hides behind the epilogue. A program
that returns before the trigger counts as having triggered.

Launched without PDL (the default) both instructions do nothing. They exist from sm_90
(Hopper) on: for an older GPU (the target Triton compiles for, `cuda_capability_geq`) the
functions are empty, as they are under the Triton interpreter or with a Triton without the
grid dependency intrinsics.
"""

import triton
import triton.language as tl

from kernels.jit.interpreter_compat import interpreter_enabled

HAS_GRID_DEPENDENCY_CONTROL = not interpreter_enabled() and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

if HAS_GRID_DEPENDENCY_CONTROL:

    @triton.jit
    def wait_for_previous_grid():
        if tl.target_info.cuda_capability_geq(9, 0):
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def let_next_grid_launch():
        if tl.target_info.cuda_capability_geq(9, 0):
            tl.extra.cuda.gdc_launch_dependents()

else:

    @triton.jit
    def wait_for_previous_grid():
        pass

    @triton.jit
    def let_next_grid_launch():
        pass


@triton.jit
def after_previous_grid():
    wait_for_previous_grid()
    let_next_grid_launch()
