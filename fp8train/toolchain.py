"""The compiler fp8train's float8 kernels go through on CUDA, checked for a known miscompile.

Triton assembles its kernels with ptxas, by default the copy it ships. For Hopper (sm_90),
ptxas 12.8 and 12.9 (what Triton 3.6, torch 2.11's, ships) can miscompile a kernel that stores
a float8 value both row-major and column-major: a shift extracting the second byte of a
converted pair reads its register before the pair is written there, so the column-major copy
holds stale bytes (triton-lang/triton#11111). fp8train's casts write both layouts of
grad_output, and of weights and inputs, from one kernel. On an H100, a compiled LLaMA-style
model with inductor's coordinate-descent tuning went NaN from its second step with Triton's
ptxas and trained normally with CUDA 13.0's, the kernels' bytes likewise
(benchmarks/results/ptxas_hazard_h100_2026-12-06.md).

Triton is not always left to its own ptxas: torch's CUDA 13 wheels ship ptxas 13.0
(torch/bin/ptxas), and inductor points Triton at it just before its first compile in a
process, where TRITON_PTXAS_PATH is unset. Kernels compiled before that, or off that path
(likely: kernels compiled while a process's graphs come from inductor's cache), still get
Triton's own. `adopt_torch_ptxas()` makes inductor's choice as the first Float8Linear is
built, for the whole process.

`toolchain_problem()` says whether this process is exposed after that, and what to do;
convert_to_float8_training warns with it once per process (a `ToolchainWarning`). Where it is
exposed, Float8LinearConfig's default compiled_transpose_kernels="auto" turns the transpose
kernels on (`auto_transpose_roles()`), so that no compiled kernel stores float8 bytes in both
layouts.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import warnings

import torch

from fp8train.config import Role

FIXED_PTXAS = (13, 0)
"""The first ptxas release seen to compile the kernels right for sm_90 (CUDA 13.0, H100)."""

AFFECTED_CAPABILITIES = frozenset({(9, 0)})
"""Compute capabilities whose code Triton assembles with its Hopper ptxas (12.x)."""


class ToolchainWarning(UserWarning):
    """Triton would compile fp8train's kernels with a compiler that miscompiles them."""


def _version(text: str) -> tuple[int, int] | None:
    found = re.search(r"release (\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


@functools.cache
def _ptxas_version(path: str) -> tuple[int, int] | None:
    """The release of the ptxas at `path` (asked once per process: the checks ask for the same
    few paths again and again), or None if it does not run."""
    try:
        output = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return _version(output)


def _triton_ptxas() -> str | None:
    """The ptxas Triton assembles sm_90 code with (TRITON_PTXAS_PATH, else its own)."""
    try:
        import triton
    except ImportError:
        return None
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return None
    try:
        return knobs.nvidia.ptxas.path
    except (AttributeError, RuntimeError, OSError):
        return None


def ptxas_in_use() -> str | None:
    """The ptxas Triton assembles sm_90 code with, for a result's header: its release and
    "Triton's own" or its path (TRITON_PTXAS_PATH); None without Triton."""
    path = _triton_ptxas()
    if path is None:
        return None
    return _described(path, "Triton's own" if os.path.dirname(path) == _triton_bin() else path)


def _described(path: str, where: str) -> str | None:
    """The ptxas at `path` as "13.0 (where)", or None if it does not run."""
    version = _ptxas_version(path)
    return f"{version[0]}.{version[1]} ({where})" if version else None


def _triton_bin() -> str | None:
    """The folder of the tools Triton ships for NVIDIA GPUs."""
    try:
        import triton
    except ImportError:
        return None
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _newer_ptxas() -> str | None:
    """A ptxas of FIXED_PTXAS or later on this machine (torch's, PATH, CUDA_HOME,
    /usr/local/cuda)."""
    candidates = [_torch_ptxas(), shutil.which("ptxas")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "ptxas"))
    for path in dict.fromkeys(c for c in candidates if c and os.path.isfile(c)):
        version = _ptxas_version(path)
        if version is not None and version >= FIXED_PTXAS:
            return path
    return None


def describe_problem(
    capability: tuple[int, int], ptxas: str, version: tuple[int, int], newer: str | None
) -> str | None:
    """The warning for a GPU of `capability` whose kernels Triton assembles with `ptxas` of
    `version`, `newer` a fixed ptxas found on the machine; None where nothing is wrong."""
    if capability not in AFFECTED_CAPABILITIES or version >= FIXED_PTXAS:
        return None
    fix = (
        f"set TRITON_PTXAS_PATH={newer} (found here) before Python starts"
        if newer
        else "install the CUDA 13.0 toolkit or later and point TRITON_PTXAS_PATH at its "
        "bin/ptxas before Python starts"
    )
    return (
        f"Triton assembles this sm_{capability[0]}{capability[1]} GPU's kernels with ptxas "
        f"{version[0]}.{version[1]} ({ptxas}), which can write stale bytes into the "
        "column-major copy of a float8 tensor that the same kernel stores row-major "
        "(triton-lang/triton#11111). fp8train's casts store both layouts from one kernel; on "
        "an H100 a compiled model with inductor's coordinate_descent_tuning went NaN with it, "
        "and its SASS shows the faulty pattern at inductor's common block sizes too. "
        "Meanwhile fp8train's compiled casts write one layout per kernel and copy the other "
        "with a transpose kernel (Float8LinearConfig(compiled_transpose_kernels='auto'), the "
        "default), which avoids the pattern at some cost in speed; a config that sets it "
        "False is exposed, and so are other libraries' float8 kernels. "
        f"Fix: {fix}. The ptxas of CUDA 13.0 compiled the same kernels "
        "right. Silence this with warnings.filterwarnings('ignore', "
        "category=fp8train.ToolchainWarning)."
    )


def _torch_ptxas() -> str | None:
    """The ptxas torch's CUDA wheels ship (torch/bin/ptxas; 13.0 in the CUDA 13 builds of
    torch 2.11), or None."""
    path = os.path.join(os.path.dirname(torch.__file__), "bin", "ptxas")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


@functools.cache
def adopt_torch_ptxas() -> str | None:
    """Point Triton at torch's own ptxas now (TRITON_PTXAS_PATH), where the variable is unset
    and that ptxas is FIXED_PTXAS or later; returns its path, or None where nothing changed.

    Inductor makes the same choice itself, but only on its compile path, just before its
    first compile in a process (torch._inductor.runtime.compile_tasks sets the variable to
    torch/bin/ptxas when it is unset). Until then, and on paths that skip that call, Triton
    assembles with its own ptxas: so did fp8train's eager kernels compiled before any
    inductor compile, and, likely, kernels compiled while a process's graphs came from
    inductor's cache (the NaN of benchmarks/results/ptxas_hazard_h100_2026-12-06.md). Made
    here, the same choice holds for the whole process. A variable the user set is left
    alone."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None or not torch.cuda.is_available():
        return None
    path = _torch_ptxas()
    version = _ptxas_version(path) if path else None
    if version is None or version < FIXED_PTXAS:
        return None
    os.environ["TRITON_PTXAS_PATH"] = path
    return path


@functools.cache
def toolchain_problem() -> str | None:
    """What is wrong with the compiler Triton would use for this machine's GPUs, and the fix;
    None without CUDA, without Triton, or where nothing known is wrong. Found once per
    process (Triton reads TRITON_PTXAS_PATH as the process starts its compile workers),
    after adopt_torch_ptxas()."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    adopt_torch_ptxas()
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    affected = sorted(capabilities & AFFECTED_CAPABILITIES)
    if not affected:
        return None
    ptxas = _triton_ptxas()
    version = _ptxas_version(ptxas) if ptxas else None
    if version is None:
        return None
    return describe_problem(affected[0], ptxas, version, _newer_ptxas())


@functools.cache
def warn_once_about_toolchain() -> None:
    """Warn (ToolchainWarning) once per process if toolchain_problem() finds one."""
    problem = toolchain_problem()
    if problem is not None:
        warnings.warn(problem, ToolchainWarning, stacklevel=3)


_auto_transpose_roles: frozenset[Role] = frozenset()


def resolve_auto_transpose() -> None:
    """Decide what compiled_transpose_kernels="auto" means in this process: every role where
    toolchain_problem() finds one, none elsewhere (after adopt_torch_ptxas()). Called when a
    Float8Linear is built, outside any traced code (toolchain_problem runs ptxas once)."""
    global _auto_transpose_roles  # noqa: PLW0603 (one answer per process, read by traced code)
    _auto_transpose_roles = frozenset(Role) if toolchain_problem() is not None else frozenset()


def auto_transpose_roles() -> frozenset[Role]:
    """The roles whose compiled casts "auto" gives the transpose kernel, as last resolved.
    Traced code reads it: torch.compile guards on the value."""
    return _auto_transpose_roles


def report() -> list[tuple[str, str]]:
    """What `python -m fp8train env` prints: the versions and devices fp8train runs on, the
    ptxas Triton would use, any known problem with it, and what "auto" resolves to."""
    import fp8train

    facts = [("fp8train", fp8train.__version__), ("torch", torch.__version__)]
    facts.append(("CUDA (torch built with)", str(torch.version.cuda)))
    for name in ("triton", "torchao"):
        try:
            facts.append((name, __import__(name).__version__))
        except Exception:  # noqa: BLE001 (absent or broken: either way not usable)
            facts.append((name, "not importable"))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            name = torch.cuda.get_device_name(index)
            facts.append((f"GPU {index}", f"{name} (sm_{major}{minor})"))
        torch_ptxas = _torch_ptxas()
        shipped = _described(torch_ptxas, torch_ptxas) if torch_ptxas else None
        facts.append(("ptxas torch ships", shipped or "none"))
    else:
        facts.append(("GPU", "none: float8 gemms run on the CPU (tensorwise, rowwise) or emulated"))
    problem = toolchain_problem()  # adopts torch's ptxas first, where it is the fix
    if torch.cuda.is_available():
        facts.append(("ptxas Triton uses", ptxas_in_use() or "none found"))
    facts.append(("known compiler problem", problem or "none"))
    resolve_auto_transpose()
    auto = "on (every role)" if auto_transpose_roles() else "off"
    facts.append(('compiled_transpose_kernels="auto"', auto))
    return facts
