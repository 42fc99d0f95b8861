"""Programmatic dependent launch (kernels/pdl.py): when a launch asks for it, and that every
Triton kernel waits for the grid before it first (the device side: kernels/jit/pdl.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels import pdl
from kernels.pdl import (
    PDL_ENV_VAR,
    launch_options,
    pdl_requested,
    prefetches_weights,
    programmatic_dependent_launch,
)

JIT_DIR = Path(__file__).resolve().parents[2] / "kernels" / "jit"


def on_cuda(index=0):
    """A stand-in for a tensor on a CUDA device (only its `device` is read)."""
    return SimpleNamespace(device=torch.device("cuda", index))


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(PDL_ENV_VAR, raising=False)
    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: True)
    assert not pdl_requested()
    assert launch_options(on_cuda()) == {}


def test_the_variable_asks_for_it_on_a_device_that_takes_it(monkeypatch):
    monkeypatch.setenv(PDL_ENV_VAR, "1")
    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: index == 0)  # device 1: before Hopper
    assert launch_options(on_cuda(0)) == {"launch_pdl": True}
    assert launch_options(on_cuda(1)) == {}
    assert launch_options(torch.zeros(1)) == {}  # CPU tensors (the interpreter) never


def test_the_context_sets_the_variable_for_its_block(monkeypatch):
    monkeypatch.setenv(PDL_ENV_VAR, "1")
    monkeypatch.setattr(pdl, "_device_takes_pdl", lambda index: True)
    with programmatic_dependent_launch(False):
        assert launch_options(on_cuda()) == {}
        with programmatic_dependent_launch(True):
            assert launch_options(on_cuda()) == {"launch_pdl": True}
        assert not pdl_requested()
    assert pdl_requested()


def test_a_kernel_prefetches_its_weights_only_when_launched_with_pdl(monkeypatch):
    monkeypatch.delenv("VLM_CATALOG_KERNELS_OFF", raising=False)
    assert prefetches_weights({"launch_pdl": True})
    assert not prefetches_weights({})  # without PDL the wait returns at once: nothing to overlap
    monkeypatch.setenv("VLM_CATALOG_KERNELS_OFF", "pdl_weight_prefetch")
    assert not prefetches_weights({"launch_pdl": True})


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv(PDL_ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="VLM_CATALOG_PDL='sometimes' is not a flag"):
        pdl_requested()


def kernel_functions():
    """(module, kernel) for every `@triton.jit` function named *_kernel in kernels/jit."""
    for path in sorted(JIT_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                yield path.name, node


def statement_call(statement) -> str | None:
    """The name a statement of the form `name()` calls, else None."""
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
        return getattr(statement.value.func, "id", None)
    return None


# what a kernel may do before it waits: compute its program's indices, and under PREFETCH_WEIGHT
# ask for its weights into L2 (kernels/jit/l2_prefetch.py), which no grid writes
CALLS_BEFORE_THE_WAIT = {"program_id", "arange", "minimum", "zeros", "to", "prefetch_rows_to_l2"}


def calls_in(statement) -> set[str]:
    return {getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            for node in ast.walk(statement) if isinstance(node, ast.Call)}


def test_every_kernel_waits_for_the_grid_before_it_before_touching_memory():
    # a kernel launched with launch_pdl=True may start while the one before it still runs: before
    # the wait it loads and stores nothing (the docstring aside); it may prefetch its weights, only
    # under PREFETCH_WEIGHT
    kernels = list(kernel_functions())
    assert len(kernels) >= 18
    prefetching = set()
    for module, kernel in kernels:
        body = [s for s in kernel.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        waits = [i for i, s in enumerate(body) if statement_call(s) in ("after_previous_grid", "wait_for_previous_grid")]
        assert waits, f"{module}: {kernel.name} never waits for the grid before it"
        for statement in body[:waits[0]]:
            assert calls_in(statement) <= CALLS_BEFORE_THE_WAIT, f"{module}: {kernel.name} before its wait"
            if "prefetch_rows_to_l2" in calls_in(statement):
                assert isinstance(statement, ast.If) and getattr(statement.test, "id", None) == "PREFETCH_WEIGHT", \
                    f"{module}: {kernel.name} prefetches outside `if PREFETCH_WEIGHT:`"
                prefetching.add(kernel.name)
    assert prefetching == {"skinny_linear_kernel", "add_rms_norm_router_kernel"}


def test_a_kernel_that_waits_alone_lets_the_next_grid_launch_once_after_its_main_loop():
    # `wait_for_previous_grid` leaves the trigger to a later `let_next_grid_launch()`: one, in the
    # kernel's own body (every program that does not return early reaches it), after a loop
    late = {}
    for module, kernel in kernel_functions():
        body = kernel.body
        if not any(statement_call(s) == "wait_for_previous_grid" for s in body):
            continue
        triggers = [i for i, s in enumerate(body) if statement_call(s) == "let_next_grid_launch"]
        nested = [node for node in ast.walk(kernel) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) == "let_next_grid_launch"]
        assert len(triggers) == len(nested) == 1, f"{module}: {kernel.name}"
        assert any(isinstance(node, ast.For) for s in body[:triggers[0]] for node in ast.walk(s)), \
            f"{module}: {kernel.name} triggers before its loop"
        late[kernel.name] = module
    # the batch-1 decode step's kernels (the 2026-11-28 step: 7 per layer)
    assert {"skinny_linear_kernel", "paged_decode_split_kernel", "add_rms_norm_router_kernel", "moe_gate_up_silu_kernel",
            "moe_down_kernel"} <= set(late)


def kernel_launches():
    """(file, kernel name, call) for every `<name>_kernel[grid](...)` launch in kernels/."""
    root = JIT_DIR.parent
    for path in sorted([*root.glob("*.py"), *root.glob("moe/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and getattr(node.func.value, "id", "").endswith("_kernel")):
                yield path.relative_to(root).as_posix(), node.func.value.id, node


def test_every_launch_passes_the_launch_options():
    launches = list(kernel_launches())
    assert len(launches) >= 18
    for path, name, call in launches:
        spread = [k.value for k in call.keywords if k.arg is None]  # **mapping arguments
        source = (JIT_DIR.parent / path).read_text()
        called = any(getattr(value.func, "id", None) == "launch_options" for value in spread
                     if isinstance(value, ast.Call))
        named = any(f"{value.id} = launch_options(" in source for value in spread if isinstance(value, ast.Name))
        assert called or named, f"{path}: {name} is launched without **launch_options(...)"
