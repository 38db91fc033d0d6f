"""Find, on a machine without a GPU, the Hopper kernels whose float8 bytes ptxas 12.x
miscompiles (triton-lang/triton#11111):

    python -m benchmarks.sass_hazards                                  # Triton's ptxas
    python -m benchmarks.sass_hazards --ptxas /usr/local/cuda/bin/ptxas
    python -m benchmarks.sass_hazards --configs "tensorwise delayed one-pass" --transpose
    python -m benchmarks.sass_hazards --dump ptx/                      # PTX for another ptxas

Needs Triton (3.6) beside a CPU build of torch. A float8 conversion yields two values packed
in a 16-bit register (`cvt.rn.satfinite.e5m2x2.f32 %rs5, ...`). Where a kernel stores the
values row-major (the pair whole, in a vector store) and also column-major (byte by byte,
the second byte as `shr.u16 %rs65, %rs5, 8`), ptxas 12.8 and 12.9 for sm_90 can place the
pair in the low half of a register that a `PRMT R, X, 0x7610, R` fills only after the
shift has read it. The column-major copy then gets a stale byte: the previous loop
iteration's, or whatever the register held before (thread-index bits at the start). On the
H100 that was 25% of the column-major bytes of a hand-written SwiGLU-backward cast
(benchmarks/bench_swiglu_backward.py), and ptxas 13.0 compiled the same kernels correctly.
See benchmarks/results/ptxas_hazard_h100_2026-12-06.md.

The scan compiles, for sm_90: bench_swiglu_backward's kernels (the control: the GPU showed
their column-major bytes wrong), fp8train's eager cast kernel writing both layouts (from a
16-bit input, and from fp32, a second control), and the
Triton kernels inductor generates for the backward of a compiled LLaMA-style block per
config (each over a set of block sizes, as autotuning would try them), assembles each with
the chosen ptxas, and counts in the SASS the signature above, in two forms: a
`SHF.R.U32.HI Rd, RZ, 0x8, Rs`, or a copy of the low half `LOP3.LUT Rd, Rs, 0xffff, RZ, ...`
that is shifted by 8 later, reading Rs (not written last by a float8 conversion, F2FP) before
the next write of Rs, a `PRMT Rs, Rx, 0x7610, Rs`. A heuristic for what was read here: with
Triton's ptxas 12.8 it flags 10 of the control's 11 configurations (on the H100 all 11 wrote
wrong bytes), and with CUDA 13.0's ptxas none of any kernel (on the H100 none wrote wrong
bytes). A flag is evidence; no flag proves nothing, and only a GPU run of the bytes
(tests/test_inductor.py's both-layouts test) checks a kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.utils import markdown_table, print_environment
from fp8train.toolchain import _triton_bin

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")

BLOCK_SIZES = {
    "pointwise": [{"XBLOCK": x, "warps": w} for x, w in [(1024, 4), (512, 4), (2048, 8)]],
    "tiled pointwise": [
        {"XBLOCK": x, "YBLOCK": y, "warps": w}
        for x, y, w in [(64, 64, 4), (32, 32, 4), (32, 128, 4), (128, 32, 4), (16, 256, 4)]
    ],
    "reduction": [
        {"XBLOCK": x, "R0_BLOCK": r, "warps": w}
        for x, r, w in [(1, 1024, 8), (1, 2048, 8), (8, 128, 4), (64, 8, 4), (1, 256, 4)]
    ],
    "persistent reduction": [{"XBLOCK": x, "warps": w} for x, w in [(1, 4), (1, 8), (8, 8)]],
}
"""Per kind of generated kernel: the block sizes and warps each is compiled with."""


def _instructions(sass: str) -> list[tuple[int, str, list[str]]]:
    """(address, opcode, operands without `.reuse`) of each instruction in cuobjdump's SASS."""
    out = []
    for line in sass.splitlines():
        match = _INSTRUCTION.search(line)
        if match:
            operands = [op.strip().removesuffix(".reuse") for op in match.group(3).split(",")]
            out.append((int(match.group(1), 16), match.group(2), [op for op in operands if op]))
    return out


def _next_write(instructions: list, start: int, register: str) -> int | None:
    """The index of the first instruction from `start` on that writes `register`, before any
    branch; None if none."""
    for index in range(start, len(instructions)):
        _, opcode, operands = instructions[index]
        if opcode.startswith(("BRA", "EXIT", "RET")):
            return None
        if operands and operands[0] == register and not opcode.startswith("ST"):
            return index
    return None


def _shifted_by_8(instructions: list, start: int, register: str) -> bool:
    """Whether `register` is shifted right by 8 bits from `start` on, before it is rewritten."""
    for _, opcode, operands in instructions[start:]:
        if opcode.startswith(("BRA", "EXIT", "RET")):
            return False
        if opcode.startswith("SHF.R.U32.HI") and operands[1:] == ["RZ", "0x8", register]:
            return True
        if operands and operands[0] == register and not opcode.startswith("ST"):
            return False
    return False


def _holds_a_pair(instructions: list, end: int, register: str) -> bool:
    """Whether the last write of `register` before `end`, in the same straight line, is a
    float8 conversion (F2FP): then a read of it at `end` reads that pair, as it should."""
    for _, opcode, operands in reversed(instructions[:end]):
        if opcode.startswith(("BRA", "EXIT", "RET")):
            return False
        if operands and operands[0] == register and not opcode.startswith("ST"):
            return opcode.startswith("F2FP")
    return False


def stale_byte_reads(sass: str) -> list[tuple[int, int, str]]:
    """(address of the read, address of the merge, register) for each second-byte extraction
    that reads a register before a PRMT merges its low half in (the signature above): a shift
    by 8 of the register, or of a copy of its low half (`LOP3.LUT Rd, Rs, 0xffff, ...`)
    shifted later."""
    instructions = _instructions(sass)
    found = []
    for index, (address, opcode, operands) in enumerate(instructions):
        if len(operands) < 4 or not operands[0].startswith("R"):
            continue
        target = operands[0]
        if opcode.startswith("SHF.R.U32.HI") and operands[1:3] == ["RZ", "0x8"]:
            source = operands[3]
        elif opcode.startswith("LOP3.LUT") and operands[2:4] == ["0xffff", "RZ"]:
            source = operands[1]
            if not _shifted_by_8(instructions, index + 1, target):
                continue
        else:
            continue
        if (
            not source.startswith("R")
            or source == target
            or _holds_a_pair(instructions, index, source)
        ):
            continue
        write = _next_write(instructions, index + 1, source)
        if write is None:
            continue
        merge, merge_opcode, merge_operands = instructions[write]
        if merge_opcode == "PRMT" and merge_operands[2:] == ["0x7610", source]:
            found.append((address, merge, source))
    return found


def _triton_tools() -> tuple[str, str]:
    folder = Path(_triton_bin())
    return str(folder / "ptxas"), str(folder / "cuobjdump")


def _sass(ptx: str, ptxas: str, cuobjdump: str) -> str:
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        subprocess.run([ptxas, "-arch=sm_90a", str(source), "-o", str(cubin)], check=True)
        return subprocess.run(
            [cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True
        ).stdout


def _ptx(fn, signature: dict, constants: dict, attrs: dict, warps: int) -> str:  # noqa: ANN001
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(
        ASTSource(fn, signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    return compiled.asm["ptx"]


def eager_cast_kernels() -> list[tuple[str, str, str]]:
    """(kernel, config, PTX) of fp8train's cast kernel writing both layouts in one launch: as
    cast_2d launches it (a 16-bit input, the scale from the amax), and from an fp32 input,
    which cast_2d splits into two launches because on an H200 its column-major copy came out
    wrong (a second control)."""
    from fp8train.kernels.cast import TILE, _cast_kernel

    out = []
    for hp, fp8, record, tile in itertools.product(
        ["bf16", "fp32"], ["fp8e4nv", "fp8e5"], [False, True], [TILE, (64, 64, 4), (64, 128, 8)]
    ):
        pointers = ["hp_ptr", "scale_ptr", "row_ptr", "col_ptr", "scale_out_ptr",
                    "inverse_out_ptr", "amax_out_ptr"]  # fmt: skip
        types = [f"*{hp}", "*fp32", f"*{fp8}", f"*{fp8}", "*fp32", "*fp32", "*fp32"]
        signature = dict(zip(pointers, types, strict=True))
        signature |= dict.fromkeys(["M", "N", "stride_hm", "amax_count"], "i32")
        constants = {
            "stride_hn": 1, "stride_sm": 0, "stride_sn": 0,
            "FP8_MAX": 448.0 if fp8 == "fp8e4nv" else 57344.0, "EPS": 1e-12,
            "SCALE_FROM_AMAX": True, "WRITE_INVERSE": True, "POW2": False, "WRITE_ROW": True,
            "WRITE_COL": True, "RECORD_AMAX": record, "AMAX_BLOCK": 1,
            "BLOCK_M": tile[0], "BLOCK_N": tile[1],
        }  # fmt: skip
        signature |= dict.fromkeys(constants, "constexpr")
        aligned = [n for n in signature if signature[n] != "constexpr" and n != "amax_count"]
        attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in aligned}
        ptx = _ptx(_cast_kernel, signature, constants, attrs, tile[2])
        config = f"{fp8}, {tile[0]}x{tile[1]}, warps={tile[2]}" + (", amax" if record else "")
        kernel = "fp8train cast kernel" + (
            "" if hp == "bf16" else ", fp32 input (cast_2d launches it twice instead)"
        )
        out.append((kernel, config, ptx))
    return out


def swiglu_backward_kernels() -> list[tuple[str, str, str]]:
    """(kernel, config, PTX) of benchmarks/bench_swiglu_backward.py's row and tile kernels:
    the control, whose column-major bytes the H100 showed wrong with Triton's ptxas."""
    from benchmarks.bench_swiglu_backward import (
        ROWS,
        TILES,
        swiglu_rows_kernel,
        swiglu_tiles_kernel,
    )

    pointers = ["gate", "up", "grad_h", "scales", "h_col", "g1_row", "g1_col", "g3_row",
                "g3_col", "amax1", "amax3"]  # fmt: skip
    types = ["*bf16"] * 3 + ["*fp32", "*fp8e4nv"] + ["*fp8e5"] * 4 + ["*i32"] * 2
    signature = dict(zip(pointers, types, strict=True)) | {"M": "i32", "F": "i32"}
    attrs = {(index,): [["tt.divisibility", 16]] for index in range(len(signature))}
    out = []
    for block, warps in ROWS:
        constants = {"BLOCK": block, "COLUMN_MAJOR": True, "AMAX": True}
        ptx = _ptx(swiglu_rows_kernel, signature | dict.fromkeys(constants, "constexpr"),
                   constants, attrs, warps)  # fmt: skip
        out.append(("bench_swiglu_backward rows", f"BLOCK={block}, warps={warps}", ptx))
    for bm, bn, warps in TILES:
        constants = {"BM": bm, "BN": bn}
        ptx = _ptx(swiglu_tiles_kernel, signature | dict.fromkeys(constants, "constexpr"),
                   constants, attrs, warps)  # fmt: skip
        out.append(("bench_swiglu_backward tiles", f"{bm}x{bn}, warps={warps}", ptx))
    return out


def _kind(source: str) -> str:
    """kernel_instructions' kind of a generated kernel, persistent reductions told apart."""
    from benchmarks.kernel_instructions import _kind as kind

    return "persistent reduction" if "persistent_reduction" in source else kind(source)


def generated_kernels(name: str, transpose: bool) -> list[tuple[str, str, str]]:
    """(kernel, config, PTX) of each Triton kernel with a float8 store that inductor generates
    for the backward of a small LLaMA-style block converted as CONFIGS[name] says, compiled
    with each of BLOCK_SIZES. `transpose`: with compiled_transpose_kernels=True, its op
    opaque to inductor as on a GPU."""
    import fp8train.cast
    from benchmarks import saved_by_block
    from benchmarks.kernel_instructions import generated_backward_kernels, load_generated_kernel
    from fp8train.inductor import SatfinitePass
    from fp8train.models import ModelArgs

    config = saved_by_block.CONFIGS[name]
    if transpose:
        fp8train.cast._transpose_op = saved_by_block._opaque_transpose_op
        config = dataclasses.replace(config, compiled_transpose_kernels=True)
    args = ModelArgs(dim=256, n_heads=2, ffn_dim=896, max_seq_len=512)
    base, inputs = saved_by_block.block_and_inputs(args, 512)
    block = saved_by_block.configured(base, name, config)
    graph_pass = SatfinitePass(any_device=True, integer_amax=True, satfinite=True)
    steps = 2 if "delayed" in name else 1
    sources = generated_backward_kernels(block, steps, *inputs, graph_pass=graph_pass)
    out = []
    for number, source in enumerate(dict.fromkeys(sources)):
        if "fp8" not in source:
            continue
        kernel, signature = load_generated_kernel(source)
        found = re.search(r"'configs': \[(\{.*?\})\]", source)
        attrs = eval(found.group(1)) if found else {}  # noqa: S307
        kind = _kind(source)
        stores = len(re.findall(r"tl\.store\(", source))
        for sizes in BLOCK_SIZES[kind]:
            constants = {k: v for k, v in sizes.items() if k != "warps"}
            if any(k not in signature for k in constants):
                continue
            ptx = _ptx(kernel, signature, constants, attrs, sizes["warps"])
            blocks = ", ".join(f"{k}={v}" for k, v in sizes.items())
            out.append((f"{name}: kernel {number} ({kind}, {stores} stores)", blocks, ptx))
    return out


def main(args: argparse.Namespace) -> list[dict]:
    print_environment()
    triton_ptxas, cuobjdump = _triton_tools()
    ptxas = args.ptxas or triton_ptxas
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    print(f"- ptxas: {ptxas} ({version.strip().splitlines()[-1]})")
    kernels = swiglu_backward_kernels() + eager_cast_kernels()
    for name in args.configs:
        kernels += generated_kernels(name, args.transpose)
    if args.dump:
        Path(args.dump).mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    for number, (kernel, config, ptx) in enumerate(kernels):
        if args.dump:
            (Path(args.dump) / f"kernel_{number}.ptx").write_text(f"// {kernel}: {config}\n{ptx}")
        found = stale_byte_reads(_sass(ptx, ptxas, cuobjdump))
        row = rows.setdefault(kernel, {"kernel": kernel, "block sizes": 0, "flagged": []})
        row["block sizes"] += 1
        if found:
            row["flagged"].append(f"{config} ({len(found)})")
    table = [{**row, "flagged": "; ".join(row["flagged"]) or "none"} for row in rows.values()]
    flagged = sum(1 for row in rows.values() if row["flagged"])
    print(f"\n{flagged} of {len(rows)} kernels with the signature at some block size"
          f"{' (compiled_transpose_kernels=True)' if args.transpose else ''}")  # fmt: skip
    print(markdown_table(table))
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.saved_by_block import CONFIGS

    parser.add_argument("--ptxas", help="the ptxas to assemble with (default: Triton's)")
    parser.add_argument(
        "--configs", nargs="*", default=["tensorwise delayed one-pass"], choices=list(CONFIGS)
    )
    parser.add_argument(
        "--transpose",
        action="store_true",
        help="the configs with compiled_transpose_kernels=True (one layout per inductor kernel)",
    )
    parser.add_argument("--dump", help="a folder to write each kernel's PTX to")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    main(parser.parse_args())
