"""minimlx's build: the Python package (configured in pyproject.toml) and, where it builds, the native CPU kernel.

The kernel (native/: C++ against MLX's extension API, bound with nanobind) is an optional extension: CMake builds it
on Linux x86-64 and aarch64 when it finds a C++ compiler and Python's headers, against the MLX release of the build
environment, which pyproject.toml pins to the one minimlx itself requires. Where it cannot be built, minimlx installs
without it, says so in one line, and runs MLX's own ops on the CPU (minimlx/cpu/native.py).
"""

import platform
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PLATFORMS = {("Linux", "x86_64"), ("Linux", "aarch64")}
"""(system, machine) pairs the kernel is built on; pyproject.toml's build requirements and minimlx/cpu/native.py
name the same ones."""

ROOT = Path(__file__).parent


class BuildKernel(build_ext):
    """Configures, builds and installs native/ with CMake (and Ninja) into the package's build folder; an editable
    install then copies the library next to native/src/minimlx_native/__init__.py."""

    def build_extension(self, ext: Extension) -> None:
        system, machine = platform.system(), platform.machine()
        if (system, machine) not in PLATFORMS:
            return skipped(f"it is built on Linux x86-64 and aarch64, not on {system} {machine}")
        build = Path(self.build_temp, "native")
        steps = [
            ["cmake", "-S", ROOT / "native", "-B", build, "-G", "Ninja", f"-DPython_EXECUTABLE={sys.executable}"],
            ["cmake", "--build", build],
            ["cmake", "--install", build, "--prefix", self.build_lib],
        ]
        for step in steps:
            if subprocess.run(step).returncode != 0:
                return skipped("CMake's output above says why")


def skipped(why: str) -> None:
    print(f"minimlx: the native CPU kernel is not built ({why}); minimlx is installed without it", file=sys.stderr)


setup(
    ext_modules=[Extension("minimlx_native._ext", sources=[], optional=True)],
    cmdclass={"build_ext": BuildKernel},
)
