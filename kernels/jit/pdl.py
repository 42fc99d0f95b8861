"""The device side of programmatic dependent launch (kernels/pdl.py).

Every Triton kernel begins with `after_previous_grid()`, before it reads or writes any
memory: it waits until the grid before it in the stream has finished and its writes are
visible (``griddepcontrol.wait``), then lets the next grid launch
(``griddepcontrol.launch_dependents``; that grid waits the same way before its own work).
Launched without PDL (the default) both instructions do nothing. They exist from sm_90
(Hopper) on: for an older GPU (the target Triton compiles for, `cuda_capability_geq`) the
function is empty, as it is under the Triton interpreter or with a Triton without the grid
dependency intrinsics.
"""

import triton
import triton.language as tl

from kernels.jit.interpreter_compat import interpreter_enabled

HAS_GRID_DEPENDENCY_CONTROL = not interpreter_enabled() and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")

if HAS_GRID_DEPENDENCY_CONTROL:

    @triton.jit
    def after_previous_grid():
        if tl.target_info.cuda_capability_geq(9, 0):
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:

    @triton.jit
    def after_previous_grid():
        pass
