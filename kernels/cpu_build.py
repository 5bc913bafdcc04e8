"""Build and load the C++ CPU kernels (``kernels/csrc``), once per machine.

The instruction set is detected at run time from ``/proc/cpuinfo`` and picks
the compiler flags; the build is cached per instruction set under
``~/.cache/stallfree/kernels`` (``STALLFREE_KERNEL_CACHE`` overrides), so a
home directory shared by an AVX-512 and an AVX2 machine holds one build for
each. ``STALLFREE_CPU_ISA`` forces one this CPU can execute (tests and
benchmarks of the kinds a machine is not: ``avx512-bf16`` on an AMX Xeon,
``avx512`` on a BF16 CPU, ``avx2`` on any AVX-512 one) and turns stallfree's
own AMX paths off; ``ONEDNN_MAX_CPU_ISA`` caps oneDNN's. The machine's
*kind* (:func:`kind`) is the ISA the kernels are built for, or ``amx``.
Without a compiler, ninja or a working build, :func:`status` says
``reference`` with the reason (and logs it), and the dispatch falls back to
the torch reference.
``STALLFREE_CPU_KERNELS=reference`` forces that fallback. ``make setup``
builds it, so the first request does not wait for the compiler (~45 s here).
Built with OpenMP: every kernel splits its work over torch's threads
(``torch.set_num_threads``, the engine's ``--threads``); ``threads_used``
says how many a kernel's parallel loop actually ran on.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger("stallfree.kernels")

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "argmax.cpp",
        "attention.cpp",
        "brgemm.cpp",
        "dot_gemm.cpp",
        "elementwise.cpp",
        "gemm.cpp",
        "layers.cpp",
        "parallel.cpp",
        "roofline.cpp",
        "screen.cpp",
    )
]

# instruction set -> (flags it needs in /proc/cpuinfo, compiler flags); best first
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512-bf16": (  # AMD Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and later
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "avx512_bf16", "avx512_vnni"),
        (
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mavx2",
            "-mfma",
            "-mf16c",
        ),
    ),
    "avx512": (
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    ),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "generic": ((), ()),
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def detect_isa(flags: set[str] | None = None) -> str:
    """The best ISA this CPU executes, or ``STALLFREE_CPU_ISA`` when it names one it can."""
    flags = cpu_flags() if flags is None else flags
    runnable = [name for name, (needs, _) in ISAS.items() if all(f in flags for f in needs)]
    forced = os.environ.get("STALLFREE_CPU_ISA")
    if forced:
        if forced not in runnable:
            raise ValueError(f"STALLFREE_CPU_ISA={forced}: this CPU runs {', '.join(runnable)}")
        return forced
    return runnable[0]


def kind(flags: set[str] | None = None) -> str:
    """The machine's kind in records and logs: ``amx``, ``avx512-bf16``,
    ``avx512``, ``avx2`` or ``generic`` (a forced ISA also stands in for AMX)."""
    isa = detect_isa(flags)
    return "amx" if isa == "avx512-bf16" and has_amx(flags) else isa


def has_amx(flags: set[str] | None = None) -> bool:
    """AMX tiles for bf16 (oneDNN's GEMMs), unless ``STALLFREE_CPU_ISA`` forces an ISA."""
    if flags is None and os.environ.get("STALLFREE_CPU_ISA"):
        return False
    flags = cpu_flags() if flags is None else flags
    return {"amx_bf16", "amx_tile"} <= flags


def cache_dir(isa: str) -> Path:
    root = os.environ.get("STALLFREE_KERNEL_CACHE") or Path.home() / ".cache" / "stallfree" / "kernels"
    return Path(root) / isa


@dataclass(slots=True, frozen=True)
class Status:
    """What the CPU dispatch runs: ``native`` with its ISA, or ``reference`` and why."""

    backend: str  # native | reference
    isa: str
    reason: str = ""

    def __str__(self) -> str:
        return f"native-{self.isa}" if self.backend == "native" else f"reference ({self.reason})"


@cache
def status() -> Status:
    """Compile (the first time on this machine) and load the extension, once per process."""
    isa = detect_isa()
    if os.environ.get("STALLFREE_CPU_KERNELS", "native") == "reference":
        return Status("reference", isa, "STALLFREE_CPU_KERNELS=reference")
    # the venv's ninja is on no PATH when its python runs without activation
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    missing = [tool for tool in ("c++", "ninja") if shutil.which(tool) is None]
    if missing:
        return _fallback(isa, f"{' and '.join(missing)} not found")
    try:
        from torch.utils.cpp_extension import load

        directory = cache_dir(isa)
        directory.mkdir(parents=True, exist_ok=True)
        load(
            name=f"stallfree_cpu_{isa.replace('-', '_')}",
            sources=[str(s) for s in SOURCES],
            # -fopenmp: at::parallel_for is inline, and splits work only where the
            # including code is built with OpenMP (ATen/ParallelOpenMP.h); the runtime is
            # the libgomp torch already loaded, so torch.set_num_threads governs it
            extra_cflags=["-O3", "-std=c++17", "-fopenmp", *ISAS[isa][1]],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
    except Exception as exc:  # a failed build must not take the engine down: the reference still works
        return _fallback(isa, f"build failed: {str(exc).strip().splitlines()[-1][:200]}")
    return Status("native", isa)


def _fallback(isa: str, reason: str) -> Status:
    log.warning("CPU kernels: %s; using the torch reference", reason)
    return Status("reference", isa, reason)
