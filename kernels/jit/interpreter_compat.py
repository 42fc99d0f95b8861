"""Work-arounds for two bfloat16 gaps of the Triton interpreter, one scalar gap and one FP8 gap.

The interpreter (``TRITON_INTERPRET=1``) runs kernels with numpy, which has no
bfloat16: it stores bfloat16 values as their uint16 bit patterns. Two places
then differ from a GPU:

1. `tl.dot` calls `np.matmul` on the raw bit patterns, so a bfloat16 dot returns
   garbage (values around 1e10; triton-lang/triton#11584, where the maintainers
   answered that the interpreter does not support bfloat16 yet). We convert
   bfloat16 operands to float32 first, which is what a tensor core computes:
   bfloat16 products are exact in float32 and accumulate in float32.
2. float32 -> bfloat16 casts (`.to(tl.bfloat16)`, stores into bfloat16 memory)
   truncate the mantissa, while the GPU rounds to nearest even. The error is
   biased toward zero and compounds over a kernel's rounding points (several
   per fused MoE row), so we round to nearest even, as `cvt.rn.bf16.f32` does.

Our kernels do all other arithmetic in float32 (bfloat16 values are upcast right
after the load), so these two are enough to make the interpreter a faithful
stand-in.

3. Scalars in the interpreter are numpy arrays of shape (1,), and before Triton
   3.9 a scalar's ``__index__`` was ``int(data)``, which NumPy 2.4 refuses
   ("only 0-dimensional arrays can be converted to Python scalars"). Every loop
   with tensor bounds (``range(split_start, split_end, BLOCK_N)``) then fails:
   with triton 3.6 (the GPU image's) every interpreter test and the
   ``bench_kernels.py --interpret`` smoke run did. We install the ``__index__``
   that Triton 3.9 has (the element of a one-element array).

4. Casts to float8 e4m3 (``.to(tl.float8e4nv)``, the FP8 KV cache) round the
   mantissa without carrying into the exponent: a value that rounds up to the
   next power of two comes out at half of it (-124.5 -> -64, where the GPU's
   ``cvt.rn.satfinite.e4m3x2.f32`` gives -128). We cast through torch's
   ``float8_e4m3fn``, which rounds to nearest even and saturates like the GPU.

Applied only under the interpreter, once; `kernels.jit` applies them on import.
"""

from __future__ import annotations

import os
import warnings

_PATCHED_ATTRIBUTE = "_vlm_catalog_bfloat16_patches"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def patch_interpreter_bfloat16() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder_class = getattr(interpreter, "InterpreterBuilder", None)
    needed = ("create_dot", "create_fp_trunc")
    layout_known = (
        builder_class is not None
        and all(hasattr(builder_class, name) for name in needed)
        and hasattr(interpreter, "_convert_float")
        and hasattr(interpreter, "TensorHandle")
    )
    if not layout_known:
        warnings.warn(
            "kernels: this triton's interpreter has an unexpected layout; bfloat16 results "
            "under TRITON_INTERPRET may be wrong (see kernels/jit/interpreter_compat.py)",
            stacklevel=2,
        )
        return
    if getattr(builder_class, _PATCHED_ATTRIBUTE, False):
        return
    original_create_dot = builder_class.create_dot
    original_create_fp_trunc = builder_class.create_fp_trunc

    def to_float32_handle(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_create_dot(
            self,
            to_float32_handle(a),
            to_float32_handle(b),
            d,
            input_precision,
            max_num_imprecise_acc,
        )

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_create_fp_trunc(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round half to even
        is_nan = np.isnan(src.data)
        rounded = np.where(is_nan, (bits >> 16) | 0x40, rounded)  # keep NaNs quiet NaNs
        return interpreter.TensorHandle(rounded.astype(np.uint16), tl.bfloat16)

    builder_class.create_dot = create_dot
    builder_class.create_fp_trunc = create_fp_trunc
    setattr(builder_class, _PATCHED_ATTRIBUTE, True)


def patch_interpreter_scalar_index() -> None:
    """Item 3 of the module doc: a scalar's ``__index__`` that accepts shape (1,) data."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, _PATCHED_ATTRIBUTE, False):
        return  # another layout (nothing to fix that we know of), or already patched

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        result = original(tensor, scope, *args, **kwargs)
        # set through the scope, so the interpreter restores it after the kernel like its own patches
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        return result

    setattr(patch_lang_tensor, _PATCHED_ATTRIBUTE, True)
    interpreter._patch_lang_tensor = patch_lang_tensor


def patch_interpreter_fp8() -> None:
    """Item 4 of the module doc: casts to float8 e4m3 round and saturate as on the GPU."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder_class = getattr(interpreter, "InterpreterBuilder", None)
    if builder_class is None or not hasattr(builder_class, "create_fp_to_fp") or not hasattr(interpreter, "_convert_float"):
        return  # another layout: nothing we know how to fix
    original = builder_class.create_fp_to_fp
    if getattr(original, _PATCHED_ATTRIBUTE, False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.bfloat16, tl.float16):
            return original(self, src, dst_type, rounding_mode)
        if src.dtype.scalar == tl.bfloat16:  # stored as uint16 bit patterns
            wide = interpreter._convert_float(src.data, tl.bfloat16, tl.float32, None).view(np.float32)
        else:
            wide = np.asarray(src.data, dtype=np.float32)
        rounded = torch.from_numpy(np.ascontiguousarray(wide)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(rounded.view(torch.uint8).numpy(), tl.float8e4nv)

    setattr(create_fp_to_fp, _PATCHED_ATTRIBUTE, True)
    builder_class.create_fp_to_fp = create_fp_to_fp
