"""Put an optimized BLAS under MLX's CPU matmuls on Linux.

The Linux `mlx[cpu]` wheel links the reference (netlib) BLAS, unblocked and single-threaded.
MLX calls `cblas_sgemm` by name, and the dynamic linker binds that name when `mlx.core` is
loaded, to the first library in the global symbol scope that defines it. So a BLAS opened with
`RTLD_GLOBAL` *before* `mlx.core` is imported takes over every float32 matmul (docs/performance.md);
opened after `mlx.core`, it changes nothing, which is why `minimlx/__init__.py` imports this module first.

`MINIMLX_BLAS=off` keeps MLX's own BLAS; `MINIMLX_BLAS=/path/to/libblas.so` loads that
library instead of searching. Nothing found is not an error: MLX's BLAS stays, and the commands
that run a model say once how to get a fast one (`advice`).

On Linux x86-64 minimlx depends on the `mkl` wheel, so a plain `pip install` brings MKL. On aarch64
Linux no wheel exports the plain `cblas_*` names MLX binds to; Debian's OpenBLAS or BLIS packages do.
"""

import ctypes
import glob
import os
import site
import sys
import warnings


def candidates() -> list[str]:
    """Libraries to try, best first.

    MKL (pip package `mkl`, in this environment's `lib/`) is the fastest on Intel CPUs. On other
    CPUs it runs generic code paths, and Debian's BLIS (`libblis4-pthread`) streams weights faster. Debian's
    OpenBLAS (`libopenblas0-pthread`) comes last: fast matrix products, slow matrix-vector ones.
    """
    prefixes = dict.fromkeys([sys.prefix, site.getuserbase()])
    mkl = [path for prefix in prefixes for path in sorted(glob.glob(f"{prefix}/lib/libmkl_rt.so*"))]
    debian = f"/usr/lib/{os.uname().machine}-linux-gnu"
    blis, openblas = f"{debian}/blis-pthread/libblis.so.4", f"{debian}/openblas-pthread/libopenblas.so.0"
    return mkl + [blis, openblas] if intel_cpu() else [blis, *mkl, openblas]


def advice() -> str | None:
    """One line saying that float32 matmuls run on MLX's reference BLAS and how to fix it, or None when
    they do not, or cannot be known (another BLAS is loaded, `MINIMLX_BLAS=off` asked for MLX's own, the platform
    is not Linux, or `mlx.core` was imported before minimlx, so no search ran)."""
    if loaded or not searched:
        return None
    fix = "pip install mkl" if os.uname().machine == "x86_64" else "apt-get install libopenblas0-pthread"
    return f"note: MLX runs on its reference BLAS here, so CPU matmuls are about 20x slower; to fix it: {fix}"


def intel_cpu() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return "GenuineIntel" in cpuinfo.read(1024)


def load() -> str | None:
    """Open the first BLAS that loads into the global symbol scope; return its path."""
    setting = os.environ.get("MINIMLX_BLAS", "")
    if setting == "off" or not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return None
    for path in [setting] if setting else candidates():
        if not os.path.exists(path):
            continue
        if "libmkl_rt" in path:
            # MKL's GNU OpenMP layer shares one thread pool with torch and libgomp users
            # instead of starting a second OpenMP runtime that fights them for the cores.
            os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
            # OpenMP threads that sleep between products instead of spinning: on a machine busier than its
            # cores, spinning threads starve the thread holding the work (docs/performance.md, "The knobs").
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            ctypes.CDLL(path, os.RTLD_GLOBAL)
        except OSError as e:
            warnings.warn(f"minimlx: could not load BLAS {path} ({e}); MLX keeps its own BLAS", stacklevel=2)
            continue
        return path
    if setting:
        warnings.warn(
            f"minimlx: MINIMLX_BLAS={setting} does not exist; set it to a library path or 'off'", stacklevel=2
        )
    return None


def warn_if_too_late() -> None:
    """Say once that `mlx.core` was imported before minimlx on a Linux CPU, which leaves MLX's reference BLAS under
    every float32 matmul of the process (nothing can swap it afterwards), unless a BLAS was preloaded."""
    preloaded = any(name in os.environ.get("LD_PRELOAD", "") for name in ("blas", "mkl"))
    if not sys.platform.startswith("linux") or os.environ.get("MINIMLX_BLAS") == "off" or preloaded:
        return
    if sys.modules["mlx.core"].default_device() == sys.modules["mlx.core"].cpu:
        warnings.warn(
            "minimlx: mlx.core was imported before minimlx, so MLX keeps its reference BLAS and CPU float32 "
            "matmuls run about 20x slower; import minimlx before mlx.core",
            stacklevel=3,
        )


searched: bool = (
    sys.platform.startswith("linux") and os.environ.get("MINIMLX_BLAS") != "off" and "mlx.core" not in sys.modules
)
"""Whether minimlx looked for a BLAS (on Linux, when asked to, before `mlx.core` was imported)."""
loaded: str | None = load()
"""Path of the BLAS library loaded into this process, or None when MLX keeps its own."""
if "mlx.core" in sys.modules and not searched:
    warn_if_too_late()
