"""One of Triton's own compiler passes added for the loss kernels on Hopper (``MEGABATCH_LOSS_ACC_FLAG``).

The block kernels that walk their tiles in one flattened loop (``_grad_kernel``, ``_sigmoid_kernel``) start each
tile's dot from a zeroed accumulator. For sm_90 Triton keeps that reset as a select over the accumulator's registers
(about 130 instructions a tile at 64 x 128, 4 warps: a tile's epilogue is 700-1,400); its
``optimize_accumulator_init`` pass, which Triton runs for Blackwell only, turns the reset into the tensor-core
instruction's own flag (HGMMA's "use the accumulator" predicate), so the first dot of a tile ignores the registers.
Here that pass runs once more on such a kernel's TTGIR after Triton's own passes (``knobs.runtime
.add_stages_inspection_hook``, chained to any hook already installed), for the kernels named in ``KERNELS`` only.
The kernels take ``ACC_FLAG`` as a constexpr, so a kernel compiled with the pass never shares a cache entry with one
compiled without it.

``MEGABATCH_LOSS_ACC_FLAG``: "auto" (the default) on for sm_90 where Triton has the pass and the stages hook, else
off; "1" on wherever both exist; "0" off. On an H200 (2026-12-05) the compiled kernels passed the float64 tests with
it and it left the backward's kernel as fast as before and the sigmoid pass 1-2% faster
(``docs/bench/loss_even_shared_shift_256k_h200.json``); on an H100 (2026-12-05) the sigmoid pass at b = 256k, c = 512
took 0.383 s against 0.401 s, 55.8% of the bf16 peak against 53.3%, and as before at c = 768 and in the backward
(``docs/bench/loss_acc_flag_256k_h100.json``). ``scripts/benchmarks/kernel_instructions.py`` counts the
instructions without a GPU.
"""

from __future__ import annotations

import functools
import os

ACC_FLAG = os.environ.get("MEGABATCH_LOSS_ACC_FLAG", "auto")
if ACC_FLAG not in ("auto", "0", "1"):
    raise ValueError(f"MEGABATCH_LOSS_ACC_FLAG={ACC_FLAG!r}: auto (on for Hopper where Triton has the pass), 1 (on: "
                     "the accumulator's reset as the tensor-core instruction's flag in the loss kernels) or 0 (off)")
KERNELS = frozenset({"_grad_kernel", "_sigmoid_kernel"})


@functools.cache
def available() -> bool:
    """Whether this Triton has both the stages hook and the ``optimize_accumulator_init`` pass."""
    try:
        from triton import knobs
        from triton._C.libtriton import passes
    except ImportError:
        return False
    return hasattr(knobs.runtime, "add_stages_inspection_hook") and hasattr(
        getattr(passes, "ttgpuir", None), "add_optimize_accumulator_init")


def enabled(capability: tuple[int, int]) -> bool:
    """Whether the kernels for a GPU of ``capability`` are compiled with the pass (``ACC_FLAG``)."""
    if ACC_FLAG == "0":
        return False
    return available() and (ACC_FLAG == "1" or capability[0] == 9)


def install() -> None:
    """Add the pass for ``KERNELS`` on sm_90 (idempotent; a no-op where Triton has no stages hook)."""
    from triton import knobs

    previous = getattr(knobs.runtime, "add_stages_inspection_hook", None)
    if previous is None and not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        return
    if getattr(previous, "megabatch_acc_flag", False):
        return

    def hook(*args):
        if not args:  # Triton >= 3.7 asks every hook for a part of each kernel's cache key: ours is the constexpr
            return previous() if previous is not None else ("", "")
        if previous is not None:
            previous(*args)
        _backend, stages, _options, _language, capability = args
        make = stages.get("ttgir")
        if capability // 10 == 9 and make is not None:
            stages["ttgir"] = lambda src, metadata: _flag_accumulator_init(make(src, metadata))

    hook.megabatch_acc_flag = True
    knobs.runtime.add_stages_inspection_hook = hook


def _flag_accumulator_init(module):
    if module.get_entry_func_name() in KERNELS:
        from triton._C.libtriton import ir, passes

        manager = ir.pass_manager(module.context)
        passes.ttgpuir.add_optimize_accumulator_init(manager)
        passes.common.add_canonicalizer(manager)
        manager.run(module, "megabatch_acc_flag")
    return module
