#!/usr/bin/env python
"""Compile the phased Newton-Schulz kernel for an H100 (sm_90) without a GPU and summarise its PTX.

Triton compiles for a named target on any machine, so the code the phased kernel gets (its
shared memory, whether tile loads are asynchronous 16-byte copies feeding wgmma, or single
2-byte loads) can be checked here. The variants are those the engine launches for DeePMD's
large matrices: the standard iteration of 240 x 240 matrices (padded 256 x 256) and the
Gram iteration of 240 x 1600 (se_e2_a) and 136 x 240 (DPA-2) ones.

Usage::

    python benchmarks/phased_ptx.py
"""

from __future__ import annotations

import collections
import re
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepmd_hybridmuon import kernels as K

VARIANTS = [(False, (256, 256), "fp64"), (True, (256, 1600), "fp64"), (True, (192, 256), "fp32")]
H100_SHARED_BYTES = 228 * 1024


def compile_variant(
    use_gram: bool, shape: tuple[int, int], dtype: str, first: int, stop: int
) -> triton.compiler.CompiledKernel:
    """The engine's launch of phases ``first:stop`` for one padded shape, compiled for sm_90."""
    fn = K.phased._phased_kernel
    names = fn.arg_names
    work = "*fp16" if use_gram else "*bf16"
    signature = {
        "src_ptr": f"*{dtype}", "dst_ptr": f"*{dtype}", "work_ptr": work, "meta_ptr": "*i64", "count": "i32",
        "partial_ptr": "*fp64", "coef_ptr": "*fp32", "scale_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32",
    }  # fmt: skip
    options = K.phased.phased_launch(torch.float32, use_gram, shape, first, stop).kwargs
    constants = {k: v for k, v in options.items() if k not in ("num_warps", "launch_cooperative_grid")}
    signature.update(dict.fromkeys(constants, "constexpr"))
    # pointers 16-byte aligned, as Triton's launcher marks freshly allocated buffers
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.startswith("*")}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}, attrs=attrs
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main() -> None:
    pattern = re.compile(r"(ld\.global[.\w]*|cp\.async\.cg|wgmma\.mma_async)")
    for use_gram, shape, dtype in VARIANTS:
        n = K.phase_count(use_gram)
        for first, stop in ((0, n - 1), (n - 1, n)):
            t0 = time.perf_counter()
            kernel = compile_variant(use_gram, shape, dtype, first, stop)
            counts = collections.Counter(pattern.findall(kernel.asm["ptx"]))
            shared = kernel.metadata.shared
            note = "" if shared <= H100_SHARED_BYTES else "  TOO MUCH SHARED MEMORY"
            print(
                f"{'gram' if use_gram else 'standard'} {shape} {dtype} phases {first}:{stop}: "
                f"{time.perf_counter() - t0:.1f} s, shared {shared} B{note}, {dict(counts.most_common(4))}"
            )


if __name__ == "__main__":
    main()
