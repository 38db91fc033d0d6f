"""fp8train's Triton kernels checked on a machine without a GPU, before a GPU run:

    TRITON_INTERPRET=1 python -m benchmarks.check_kernels_offline   # values, interpreted
    python -m benchmarks.check_kernels_offline                      # compiles for sm_90

Needs Triton (3.6, the version torch 2.11 ships with) and numpy < 2.3 (the interpreter's loops
fail with numpy 2.4) beside a CPU build of torch. Two checks:
1. Triton's interpreter runs the kernels through fp8train's own wrappers on CPU tensors, as if
   the machine had 3 multiprocessors: the partial-maxima amax kernel against torch's amax,
   and the cast kernel's scale and inverse against amax_to_scale, bit for bit, in fresh
   buffers and in one shared buffer as eager casts lay them out (fp8train.cast.cast_layouts).
   The interpreter rounds float8 wrongly near powers of two, so float8 bytes are compared
   only between two kernel paths (0-d amax and partial maxima), never with torch's;
   tests/test_kernels.py does that on the GPU. The transpose kernel moves bytes without
   converting them, so its column-major copy is compared with torch's, byte for byte.
2. Triton compiles every kernel for sm_90 (needs no GPU).
A diagnostic for kernel changes; the GPU tests remain the check that counts.
"""

from __future__ import annotations

import os

import torch

E4M3 = torch.float8_e4m3fn
SHAPES = [(1, 1), (40, 300), (257, 129), (0, 8), (64, 64), (130, 65)]


def interpreted() -> None:
    import fp8train.kernels.amax as amax_module
    import fp8train.kernels.launch as launch_module

    launch_module.LEAN = False  # the interpreter returns no compiled kernel to cache
    amax_module._multiprocessors = lambda index: 3
    amax_module.torch.cuda.current_device = lambda: 0
    from fp8train.kernels import amax_partials_2d, cast_2d, column_major_2d
    from fp8train.scaling import amax_to_scale

    torch.manual_seed(0)
    failures = 0
    for shape in SHAPES:
        hp = (torch.randn(shape) * 5).to(torch.bfloat16)
        want = hp.float().abs().max() if hp.numel() else torch.zeros(())
        partials = amax_partials_2d(hp)
        inverse = torch.empty(())
        scale, row, col = cast_2d(
            hp, partials, E4M3, column_major=True, scale_from_amax=True, inverse_out=inverse
        )
        _, row0, col0 = cast_2d(hp, want, E4M3, column_major=True, scale_from_amax=True)
        same_bytes = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in ((row, row0), (col, col0))
        )
        # The eager cast's layout: scale, inverse and partial maxima in one buffer.
        slots = torch.full((8 + partials.numel(),), -1.0)
        shared_scale, *_ = cast_2d(
            hp, amax_partials_2d(hp, slots[8:]), E4M3, column_major=True,
            scale_from_amax=True, scale_out=slots[0], inverse_out=slots[4],
        )  # fmt: skip
        checks = {
            "partial maxima": torch.equal(partials.max(), want),
            "scale": torch.equal(scale, amax_to_scale(want, E4M3)),
            "inverse": torch.equal(inverse, scale.reciprocal()),
            "same bytes from either amax": same_bytes,
            "column-major layout": col.t().is_contiguous(),
            "one shared buffer": torch.equal(shared_scale, scale)
            and torch.equal(slots[0], scale)
            and torch.equal(slots[4], inverse)
            and torch.equal(slots[8:], partials),
        }
        if hp.numel():  # every byte value, NaN patterns included, tiles cut at the edges
            data = torch.randint(0, 256, shape, dtype=torch.uint8).view(E4M3)
            copy = column_major_2d(data)
            checks["transpose: column-major bytes"] = copy.t().is_contiguous() and torch.equal(
                copy.t().contiguous().view(torch.uint8), data.t().contiguous().view(torch.uint8)
            )
        bad = [name for name, ok in checks.items() if not ok]
        failures += len(bad)
        print(f"{shape}: " + ("ok" if not bad else "FAILED: " + ", ".join(bad)))
    if failures:
        raise SystemExit(f"{failures} checks failed")


def compiled_for_sm90() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fp8train.kernels import amax as amax_module
    from fp8train.kernels import cast as cast_module
    from fp8train.kernels import transpose as transpose_module

    i32, fp32 = "i32", "*fp32"
    target = GPUTarget("cuda", 90, 32)
    amax_grid = dict(M=i32, N=i32, stride_hm=i32, stride_hn=i32, tiles_n=i32, tiles=i32)
    tile = dict(BLOCK_M=64, BLOCK_N=128)
    kernels = {
        "amax partials": (amax_module._amax_partials_kernel, dict(
            hp_ptr="*bf16", partials_ptr=fp32, **amax_grid,
        ), tile, 8),
    }  # fmt: skip
    for amax_block in (1, 1024):
        for scale_from_amax in (True, False):
            signature = dict(
                hp_ptr="*bf16", scale_ptr=fp32, row_ptr="*fp8e4nv", col_ptr="*fp8e4nv",
                scale_out_ptr=fp32, inverse_out_ptr=fp32, amax_out_ptr=fp32, M=i32, N=i32,
                stride_hm=i32, stride_hn=i32, stride_sm=i32, stride_sn=i32, amax_count=i32,
            )  # fmt: skip
            constexprs = dict(
                FP8_MAX=448.0, EPS=1e-12, SCALE_FROM_AMAX=scale_from_amax, WRITE_INVERSE=True,
                POW2=False, WRITE_ROW=True, WRITE_COL=True, RECORD_AMAX=not scale_from_amax,
                AMAX_BLOCK=amax_block, BLOCK_M=32, BLOCK_N=128,
            )  # fmt: skip
            name = f"cast (AMAX_BLOCK={amax_block}, scale_from_amax={scale_from_amax})"
            kernels[name] = (cast_module._cast_kernel, signature, constexprs, 4)
    block_m, block_n, num_warps = transpose_module.TILE
    kernels["transpose"] = (transpose_module._transpose_kernel, dict(
        src_ptr="*u8", dst_ptr="*u8", M=i32, N=i32,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n), num_warps)  # fmt: skip
    for name, (kernel, signature, constexprs, num_warps) in kernels.items():
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(kernel, signature, constexprs=constexprs)
        compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
        print(f"{name}: sm_90 cubin, {len(compiled.asm['cubin'])} bytes")


def main() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit(
            "check_kernels_offline needs Triton: pip install triton==3.6.0 'numpy<2.3' (in a "
            "virtual environment of its own, beside a CPU build of torch)"
        ) from None
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreted()
    else:
        compiled_for_sm90()


if __name__ == "__main__":
    main()
