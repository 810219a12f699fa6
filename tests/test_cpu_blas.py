"""The optimized BLAS that minimlx loads under MLX: same results, really used, never a broken import."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minimlx.cpu import blas

MATMULS = """
import json, sys
import numpy as np
import minimlx
import mlx.core as mx
rng = np.random.default_rng(0)
a, b = rng.standard_normal((96, 512), dtype=np.float32), rng.standard_normal((512, 384), dtype=np.float32)
with mx.stream(mx.cpu):
    np.save(sys.argv[1], np.array(mx.array(a) @ mx.array(b)))
    np.save(sys.argv[2], np.array(mx.array(a[:1]) @ mx.array(b)))
print(json.dumps(minimlx.cpu.blas.loaded))
"""


INSTALLED = [path for path in blas.candidates() if os.path.exists(path)]
NOT_INSTALLED = pytest.param(None, marks=pytest.mark.skip(reason="no optimized BLAS installed here"))


def run_python(code: str, *args, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("MINIMLX_BLAS", "MKL_THREADING_LAYER", "MKL_VERBOSE")}
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=environ | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def optimized_blas() -> str:
    if not INSTALLED:
        pytest.skip("no optimized BLAS installed here (pip install mkl, or apt-get install libopenblas0-pthread)")
    return INSTALLED[0]


def matmuls(tmp_path, name: str, **env):
    gemm, gemv = tmp_path / f"{name}_gemm.npy", tmp_path / f"{name}_gemv.npy"
    loaded = json.loads(run_python(MATMULS, gemm, gemv, **env).stdout.splitlines()[-1])
    return loaded, np.load(gemm), np.load(gemv)


@pytest.mark.slow
def test_the_best_blas_found_is_loaded(tmp_path):
    assert matmuls(tmp_path, "on")[0] == optimized_blas()


@pytest.mark.slow  # a fresh Python process
@pytest.mark.parametrize("library", INSTALLED or [NOT_INSTALLED])
def test_optimized_blas_gives_the_same_matmuls(tmp_path, library):
    loaded, gemm, gemv = matmuls(tmp_path, "on", MINIMLX_BLAS=library)
    assert loaded == library
    off, gemm_off, gemv_off = matmuls(tmp_path, "off", MINIMLX_BLAS="off")
    assert off is None
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(shape, dtype=np.float32).astype(np.float64) for shape in ((96, 512), (512, 384)))
    for result in (gemm, gemm_off):
        np.testing.assert_allclose(result, a @ b, rtol=0, atol=1e-3)
    for result in (gemv, gemv_off):
        np.testing.assert_allclose(result, a[:1] @ b, rtol=0, atol=1e-3)
    # A different BLAS sums in a different order: bit-identical results would mean MLX never called it.
    assert not np.array_equal(gemm, gemm_off)


@pytest.mark.slow  # a fresh Python process
def test_mkl_runs_mlx_matmuls_with_gnu_openmp(tmp_path):
    mkl = next((path for path in INSTALLED if "libmkl_rt" in path), None)
    if mkl is None:
        pytest.skip("MKL is not installed here (pip install mkl)")
    code = MATMULS + "import os; print(os.environ['MKL_THREADING_LAYER'])"
    out = run_python(code, tmp_path / "a.npy", tmp_path / "b.npy", MINIMLX_BLAS=mkl, MKL_VERBOSE="1").stdout
    assert out.splitlines()[-1] == "GNU"
    assert "gnu_thread" in out
    assert "SGEMM(T,N,384,96,512" in out or "SGEMM(N,N,384,96,512" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting, warning", [("off", None), ("missing", "does not exist"), ("not_a_library", "could not load")]
)
def test_import_works_without_a_usable_blas(tmp_path, setting, warning):
    (tmp_path / "not_a_library").write_text("not an ELF file")
    value = setting if setting == "off" else str(tmp_path / setting)
    process = run_python(
        "import minimlx, mlx.core as mx; "
        "print(minimlx.cpu.blas.loaded, (mx.ones((2, 3)) @ mx.ones((3, 4))).sum().item())",
        MINIMLX_BLAS=value,
    )
    assert process.stdout.split() == ["None", "24.0"]
    if warning:
        assert warning in process.stderr
    else:
        assert process.stderr == ""


@pytest.mark.slow  # a fresh Python process
def test_mlx_imported_first_is_left_alone_and_said():
    """Too late to swap the BLAS: minimlx leaves MLX's own and says so once, with the fix."""
    result = run_python("import mlx.core, minimlx; print(minimlx.cpu.blas.loaded)")
    assert result.stdout.split() == ["None"]
    warned = [line for line in result.stderr.splitlines() if "mlx.core was imported before minimlx" in line]
    assert len(warned) == 1 and warned[0].endswith("import minimlx before mlx.core"), result.stderr
    assert "imported before" not in run_python("import minimlx, mlx.core").stderr


@pytest.mark.slow  # a fresh Python process
def test_the_commands_say_once_when_mlx_keeps_its_reference_blas():
    """A missing library leaves MLX's own BLAS: `minimlx bench` says so in one line, with the fix."""
    environ = {k: v for k, v in os.environ.items() if k != "MINIMLX_BLAS"}
    result = subprocess.run(
        [sys.executable, "-m", "minimlx", "bench", "/no/such/model"],
        env=environ | {"MINIMLX_BLAS": "/no/such/libblas.so"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: MLX runs on its reference BLAS")]
    fix = "pip install mkl" if os.uname().machine == "x86_64" else "apt-get install libopenblas0-pthread"
    assert len(notes) == 1 and notes[0].endswith(f"to fix it: {fix}"), result.stderr
    assert blas.advice() is None or not INSTALLED  # with a library loaded, nothing is said
