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

``MEGABATCH_LOSS_ACC_FLAG``: "0" (the default) off; "1" on. On an H200 (2026-12-05) the compiled kernels passed the
float64 tests with it, and it left the backward's kernel as fast as before and the sigmoid pass 1-2% faster
(``docs/bench/loss_even_shared_shift_256k_h200.json``; ``scripts/benchmarks/kernel_instructions.py`` counts the
instructions without a GPU): an option, not the default.
"""

from __future__ import annotations

import os

ACC_FLAG = os.environ.get("MEGABATCH_LOSS_ACC_FLAG", "0")
if ACC_FLAG not in ("0", "1"):
    raise ValueError(f"MEGABATCH_LOSS_ACC_FLAG={ACC_FLAG!r}: 0 (off) or 1 (the accumulator's reset as the "
                     "tensor-core instruction's flag in the loss kernels, Hopper)")
KERNELS = frozenset({"_grad_kernel", "_sigmoid_kernel"})


def enabled() -> bool:
    return ACC_FLAG == "1"


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
