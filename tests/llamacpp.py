"""llama.cpp's own Hugging Face -> GGUF converter (`convert_hf_to_gguf.py`), for tests that read what it writes.

The converter's Python sources come from the llama-cpp-python sdist, which vendors llama.cpp: only
`vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/}` (2 MB) are extracted, once, into a cache
folder; `$MINIMLX_LLAMACPP` may name a llama.cpp checkout (or such a folder) instead. The converter runs in a
subprocess with its own `gguf-py`, which is usually newer than the installed `gguf` package.

llama.cpp's server test suite (`tools/server/tests/`, with the `models/templates/` its tests name) is extracted
the same way into a folder of its own, for tests/test_server_llamacpp_suite.py.

llama.cpp's own tools (`llama-tokenize`, `llama-quantize`) are built once from the same vendored sources into the
cache (`llamacpp_tool`): the whole vendored tree, cmake, two jobs, about 25 minutes on 2 cores the first time.

ggml's quantizers alone (`ggml/src/ggml-quants.c`, plain C, with the headers it includes) are compiled into a small
shared library in the cache (`ggml_quantize`): seconds, for tests that quantize as llama-quantize does
(tests/gguf_quantize.py).
"""

import concurrent.futures
import contextlib
import ctypes
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

VERSION = "0.3.36"  # llama-cpp-python's, pinning the llama.cpp it vendors
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minimlx-tests" / f"llama.cpp-{VERSION}"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
CONVERTER = "convert_hf_to_gguf.py"
LORA_CONVERTER = "convert_lora_to_gguf.py"  # a PEFT adapter -> a GGUF adapter (it imports the model converter)
LORA_CACHE = CACHE.parent / f"llama.cpp-{VERSION}-lora"
SERVER_CACHE = CACHE.parent / f"llama.cpp-{VERSION}-server-tests"
SERVER_TESTS = "tools/server/tests"
SERVER_PARTS = (f"{SERVER_TESTS}/", "models/templates/")
TOOLS = CACHE.parent / f"llama.cpp-{VERSION}-tools"  # src/: the vendored tree; build/bin/: the tools
LLAMA_QUANTIZE = Path(os.environ.get("MINIMLX_LLAMA_QUANTIZE") or TOOLS / "build" / "bin" / "llama-quantize")
# -DGGML_NATIVE=ON builds crashed with illegal instructions on one machine
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
CMAKE_FLAGS += ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=ON"]
TOOL_NAMES = ("llama-tokenize", "llama-quantize", "llama-server")  # what `llamacpp_tool` builds
QUANTS = CACHE.parent / f"llama.cpp-{VERSION}-quants"  # src/: ggml-quants.c and its headers; the library beside it
QUANTS_SOURCE = "ggml/src/ggml-quants.c"
QUANTS_PARTS = ("ggml/include/", "ggml/src/ggml-quants.", "ggml/src/ggml-common.h", "ggml/src/ggml-impl.h")
QUANTS_PARTS += ("ggml/src/ggml-cpu/ggml-cpu-impl.h",)
QUANTS_LIBRARY = "libggml-quants.so"
THREADS = os.cpu_count() or 1  # that share a tensor's rows in ggml_quantize
# the flags llama.cpp's build compiles ggml-quants.c with (into ggml-base, with no -m flags: no fused multiply-adds)
QUANTS_FLAGS = ["-O3", "-DNDEBUG", "-std=gnu11", "-D_GNU_SOURCE", "-fPIC", "-shared"]


def llamacpp_sources() -> Path:
    """A folder holding llama.cpp's converter: `$MINIMLX_LLAMACPP`, the cache, or a fresh download into the cache."""
    if folder := os.environ.get("MINIMLX_LLAMACPP"):
        if not (Path(folder) / CONVERTER).is_file():
            raise FileNotFoundError(f"MINIMLX_LLAMACPP={folder} has no {CONVERTER}")
        return Path(folder)
    if not (CACHE / CONVERTER).is_file():
        with downloaded_sdist() as sdist:
            extract(sdist, CACHE)
    return CACHE


def llamacpp_lora_sources() -> Path:
    """A folder holding llama.cpp's adapter converter beside its model converter: `$MINIMLX_LLAMACPP`, the tools'
    source tree (when they were built), the converter's cache (when it was extracted with it), or a fresh download
    into a cache folder of its own."""
    folders = [os.environ.get("MINIMLX_LLAMACPP"), TOOLS / "src", CACHE, LORA_CACHE]
    for folder in [Path(f) for f in folders if f]:
        if (folder / LORA_CONVERTER).is_file() and (folder / CONVERTER).is_file():
            return folder
    with downloaded_sdist() as sdist:
        extract(sdist, LORA_CACHE, (*PARTS, LORA_CONVERTER), LORA_CONVERTER)
    return LORA_CACHE


def convert_adapter(adapter: Path, base: Path, outtype: str, out: Path) -> None:
    """llama.cpp's `convert_lora_to_gguf.py` on the PEFT adapter folder `adapter`, whose base is the Hugging Face
    folder `base` (it reads the base's config and tokenizer): a GGUF adapter `out` for `llama-cli --lora`."""
    sources = llamacpp_lora_sources()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sources / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(sources / LORA_CONVERTER), str(adapter), "--base", str(base)]
    command += ["--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's {LORA_CONVERTER} failed:\n{done.stdout[-4000:]}")


def llamacpp_server_tests() -> Path:
    """A llama.cpp tree holding its server's test suite and the chat templates those tests name: a
    `$MINIMLX_LLAMACPP` checkout that has them, the cache, or a fresh download into the cache (its own folder,
    beside the converter's)."""
    for folder in [Path(os.environ.get("MINIMLX_LLAMACPP", SERVER_CACHE)), SERVER_CACHE]:
        if (folder / SERVER_TESTS / "utils.py").is_file():
            return folder
    with downloaded_sdist() as sdist:
        extract(sdist, SERVER_CACHE, SERVER_PARTS, f"{SERVER_TESTS}/utils.py")
    return SERVER_CACHE


def llamacpp_template(name: str) -> str:
    """The chat template llama.cpp keeps as `models/templates/{name}.jinja` (real models' templates)."""
    return (llamacpp_server_tests() / "models" / "templates" / f"{name}.jinja").read_text()


def llamacpp_tool(name: str) -> Path:
    """llama.cpp's tool `name` (`llama-tokenize`, `llama-quantize`, `llama-server`): from the cache, or built there now
    (with every tool of the list, so that one build serves them all)."""
    binary = TOOLS / "build" / "bin" / name
    if binary.is_file():
        return binary
    if not (TOOLS / "src" / "CMakeLists.txt").is_file():
        with downloaded_sdist() as sdist:
            extract(sdist, TOOLS / "src", ("",), "CMakeLists.txt")
    build = ["cmake", "--build", str(TOOLS / "build"), "-j2", "--target", *TOOL_NAMES]
    subprocess.run(["cmake", "-S", str(TOOLS / "src"), "-B", str(TOOLS / "build"), *CMAKE_FLAGS], check=True)
    subprocess.run(build, check=True)
    return binary


def llama_quantize() -> Path:
    """llama.cpp's llama-quantize: `$MINIMLX_LLAMA_QUANTIZE`, or the cache's (built there now if it is not yet)."""
    return LLAMA_QUANTIZE if os.environ.get("MINIMLX_LLAMA_QUANTIZE") else llamacpp_tool("llama-quantize")


def llama_tokenize(gguf: Path, texts: list[str], add_bos: bool) -> list[list[int]]:
    """The ids llama.cpp gives each text with `gguf`'s vocabulary: special tokens parsed, BOS where the file asks for
    it (and `add_bos`), the text as given (no escapes)."""
    command = [str(llamacpp_tool("llama-tokenize")), "-m", str(gguf), "--stdin", "--ids", "--no-escape"]
    command += ["--log-disable"] + ([] if add_bos else ["--no-bos"])
    return [
        json.loads(subprocess.run(command, input=text.encode(), capture_output=True, check=True).stdout)
        for text in texts
    ]


@functools.cache
def ggml_quants() -> ctypes.CDLL:
    """ggml-quants.c compiled alone, from the cache (or built there now). Its reference row quantizers call nothing
    outside it (ggml.c's ggml_abort only on a failed assertion, its row sizes only in the importance-matrix paths),
    so the library is loaded with lazy binding rather than linked with ggml.c and the backend code that pulls in."""
    if not (QUANTS / QUANTS_LIBRARY).is_file():
        with staged(QUANTS) as staging, downloaded_sdist() as sdist:
            extract(sdist, staging / "src", QUANTS_PARTS, QUANTS_SOURCE)
            ggml, library = staging / "src" / "ggml", staging / QUANTS_LIBRARY
            command = ["cc", *QUANTS_FLAGS, f"-I{ggml}/src", f"-I{ggml}/include", staging / "src" / QUANTS_SOURCE]
            subprocess.run([*command, "-o", library, "-lm"], check=True)
    return ctypes.CDLL(str(QUANTS / QUANTS_LIBRARY), mode=os.RTLD_LAZY)


def ggml_quantize(kind: GGMLQuantizationType, floats: np.ndarray) -> np.ndarray:
    """float32 rows (..., n) -> their blocks of `kind` (uint8, (..., n // block size * block bytes)), by ggml's
    reference quantizer `quantize_row_<kind>_ref`: what llama-quantize runs for every type of block 32 or 256
    when it is given no importance matrix. Each row is quantized on its own; the rows are shared among threads (the
    C code runs without the GIL), as llama-quantize shares them."""
    block, size = GGML_QUANT_SIZES[kind]
    if floats.shape[-1] % block:
        raise ValueError(f"rows of {floats.shape[-1]} values are not whole {kind.name} blocks of {block}")
    rows = np.ascontiguousarray(floats, np.float32).reshape(-1, floats.shape[-1])
    blocks = np.empty((len(rows), floats.shape[-1] // block * size), np.uint8)
    quantize = getattr(ggml_quants(), f"quantize_row_q{kind.name[1:]}_ref")  # Q4_K: quantize_row_q4_K_ref
    quantize.argtypes, quantize.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    step = -(-len(rows) // THREADS)

    def part(start: int) -> None:
        quantize(rows[start:].ctypes.data, blocks[start:].ctypes.data, rows[start : start + step].size)

    with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(part, range(0, len(rows), step)))
    return blocks.reshape(*floats.shape[:-1], -1)


@contextlib.contextmanager
def downloaded_sdist():
    """The llama-cpp-python sdist, downloaded by pip into a temporary folder for as long as it is needed."""
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={VERSION}", "-d", tmp], check=True, timeout=600)
        yield next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))


def extract(sdist: Path, target: Path, parts: tuple[str, ...] = PARTS, required: str = CONVERTER) -> None:
    """The files under `parts` of the sdist's vendored llama.cpp -> `target`, which must then hold `required`."""
    with staged(target) as staging, tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            _, vendored, inside = member.name.partition("/vendor/llama.cpp/")
            if vendored and inside.startswith(parts) and (member.isfile() or member.isdir()):
                member.name = inside
                members.append(member)
        tar.extractall(staging, members=members, filter="data")
        if not (staging / required).is_file():
            raise FileNotFoundError(f"{sdist.name} holds no vendor/llama.cpp/{required}")


@contextlib.contextmanager
def staged(target: Path):
    """A folder to fill, moved to `target` once filled, so that an interrupted or concurrent run never leaves a
    partial one (when another run got there first, its folder stays)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        yield staging
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Runs in the subprocess: import the converter once, then convert each (folder, outtype, outfile) in turn.
# transformers 5 forces Qwen3.5's own tokenizer class on qwen3_5_moe(_text) and qwen3_5 folders (not qwen3_5_text),
# whose pre-tokenizer turns any other vocabulary (SmolLM2's, the one at hand) into one the converter does not
# recognise: the driver lets transformers read those folders' tokenizers as their tokenizer_config.json declares.
# transformers 5 reports add_bos_token false for every tokenizer.json (it drops tokenizer_config.json's key), which
# the DeepSeek V3.2 converter asserts is true: the driver has it report tokenizer_config.json's, as transformers 4 did.
DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from transformers.models.auto import tokenization_auto
tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS -= {"qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text"}
from pathlib import Path
from transformers import tokenization_utils_tokenizers as backend
added = backend.TokenizersBackend.add_bos_token
declared = lambda self: json.loads((Path(self.name_or_path) / "tokenizer_config.json").read_text()).get("add_bos_token")
backend.TokenizersBackend.add_bos_token = property(lambda self: added.fget(self) or declared(self) is True, added.fset)
import convert_hf_to_gguf
for folder, outtype, outfile, *flags in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", outfile, *sum(flags, [])]
    convert_hf_to_gguf.main()
"""


def convert(jobs: list[tuple], sources: Path | None = None, processes: int = 2) -> None:
    """Convert Hugging Face folders to GGUF files with llama.cpp's converter: `(folder, outtype, outfile)` each, and
    optionally a list of further converter flags (`--no-mtp`), outtype one of its `--outtype` choices (f32, f16, bf16,
    q8_0, ...). The jobs are shared among up to
    `processes` processes, each importing the converter once (which takes longer than converting a tiny model);
    a failing one's log is shown."""
    sources = sources or llamacpp_sources()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sources / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    count = max(1, min(processes, os.cpu_count() or 1, len(jobs)))
    shares = [jobs[k::count] for k in range(count)]
    with tempfile.TemporaryDirectory() as logs:
        running = []
        for k, share in enumerate(shares):
            args = json.dumps([[str(folder), outtype, str(out), *flags] for folder, outtype, out, *flags in share])
            with open(Path(logs) / f"{k}.log", "w") as log:
                command = [sys.executable, "-c", DRIVER, str(sources), args]
                running.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        for k, status in enumerate([process.wait() for process in running]):
            if status != 0:
                log = (Path(logs) / f"{k}.log").read_text()
                raise RuntimeError(f"llama.cpp's {CONVERTER} failed:\n{log[-4000:]}")


def smollm2_tokenizer(gguf_path: Path) -> Path:
    """A folder holding SmolLM2's tokenizer, read from its GGUF by transformers (cached, as that takes a while): a
    vocabulary llama.cpp's converter recognises (its `smollm` pre-tokenizer), for tiny models of any architecture
    with at least its 49152 tokens."""
    folder = CACHE.parent / "smollm2-tokenizer"
    if not (folder / "tokenizer.json").is_file():
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        with staged(folder) as staging:
            tokenizer.save_pretrained(staging)
    return folder


class Reader(GGUFReader):
    """gguf's `GGUFReader` over a plain ndarray view of its memory map: the same bytes, without `np.memmap`'s
    cost on each of the reader's slices (one per token and merge: 3x faster on a 49k-token vocabulary)."""

    data = property(lambda self: self._data, lambda self, memmap: setattr(self, "_data", memmap.view(np.ndarray)))


# Text a tiny SentencePiece model is trained on: the corpora's scripts, code, digits, emoji, repeated.
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see what they think of it.",
    "Machine learning is a branch of artificial intelligence; models learn from the data they are shown.",
    "机器学习是人工智能的一个分支。你好，世界！漢字 日本語のテキスト",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))  for i in range(10): pass",
    "1234567 89 3.14159 2024-06-01 1,000,000 emoji 😀👍 café naïve «Très bien» ¿Qué tal?",
]


def sentencepiece_model(folder: Path, vocab_size: int, add_dummy_prefix: bool, specials=()) -> Path:
    """Train a tiny SentencePiece BPE model (byte fallback, digits split, as Llama's and Gemma's) into
    `folder/tokenizer.model`: what llama.cpp's converter reads for Gemma, Phi-3 and Mistral. `specials` are
    user-defined symbols (kept whole, like Gemma's `<start_of_turn>`). Trained at test time, seeded: nothing to
    commit."""
    import sentencepiece

    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "training.txt"
    text.write_text("\n".join(TRAINING_TEXT * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=list(specials),
        hard_vocab_limit=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        num_threads=1,
        minloglevel=2,
    )
    text.unlink()
    (folder / "tokenizer.vocab").unlink()
    return folder / "tokenizer.model"
