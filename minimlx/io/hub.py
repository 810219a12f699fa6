"""Models from the Hugging Face Hub: `minimlx pull REPO[:QUANT]`, `ls`, `rm`, and the download a repo id gets on
first use. huggingface_hub does the requests (it honours `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` and the cache
folders), resumes a file whose connection dropped and shows its progress bar; this module picks the files and says
in one line what went wrong (a gated repo, a missing token, an offline machine).

A folder repo (config.json and safetensors) comes whole; a GGUF repo holds one file per quantization, and
`REPO:QUANT` picks the one whose name carries that tag, as llama.cpp's `-hf repo:Q4_K_M` does (Q4_K_M when none is
named and the repo has it; the only file when it has one).
"""

import contextlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelNotFoundError

FOLDER_FILES = re.compile(r"(.*\.json|.*\.safetensors|.*\.jinja|tokenizer\.model)$")
DEFAULT_QUANT = "Q4_K_M"
TOKEN_HINT = "set HF_TOKEN to a token that has access, or log in with `hf auth login` (`huggingface-cli login`)"


@dataclass(frozen=True)
class Wanted:
    """What a pull names: a repo, and a quantization tag or a GGUF file of it (or neither)."""

    repo: str
    quant: str | None = None
    filename: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "Wanted":
        if re.fullmatch(r"[\w.-]+/[\w.-]+/[\w./-]+\.gguf", spec):
            repo, filename = spec.split("/", 2)[:2], spec.split("/", 2)[2]
            return cls("/".join(repo), filename=filename)
        repo, _, quant = spec.partition(":")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise ModelNotFoundError(f"{spec!r} is not a Hugging Face repo id; write it as ORG/NAME[:QUANT]")
        return cls(repo, quant or None)


def pull(spec: str) -> Path:
    """Download what `spec` names (or find it in the cache, offline): the checkpoint folder or the GGUF file."""
    import huggingface_hub

    wanted = Wanted.parse(spec)
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return cached(wanted)
    # the endpoint and cache as the environment says now (huggingface_hub reads them once, when imported)
    where = {"endpoint": os.environ.get("HF_ENDPOINT") or None}

    def fetch(filename: str) -> Path:
        return Path(huggingface_hub.hf_hub_download(wanted.repo, filename, cache_dir=hub_cache(), **where))

    with hub_errors(wanted.repo):
        files = [wanted.filename] if wanted.filename else huggingface_hub.HfApi(**where).list_repo_files(wanted.repo)
        if "config.json" in files:
            chosen = [f for f in files if FOLDER_FILES.fullmatch(f.rsplit("/", 1)[-1])]
            paths = [fetch(f) for f in chosen]
            return paths[chosen.index("config.json")].parent
        return fetch(wanted.filename or gguf_file(wanted, files))


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home) / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id`: the one `refs/main` names, else the newest."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip()).is_dir():
        return repo / "snapshots" / ref.read_text().strip()
    snapshots = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def cached(wanted: Wanted) -> Path:
    """What `wanted` names in the Hugging Face cache (an offline machine's pull)."""
    snapshot = cached_snapshot(wanted.repo)
    files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")] if snapshot is not None else []
    if snapshot is None or not files:
        raise ModelNotFoundError(
            f"{wanted.repo} is not in the Hugging Face cache and this machine is offline (HF_HUB_OFFLINE=1); "
            "`minimlx ls` lists what is downloaded"
        )
    if "config.json" in files:
        return snapshot
    return snapshot / (wanted.filename or gguf_file(wanted, files))


def gguf_file(wanted: Wanted, files: list[str]) -> str:
    """The GGUF file of `files` that `wanted` names by its quantization tag."""
    ggufs = [f for f in files if f.endswith(".gguf") and "mmproj" not in f.rsplit("/", 1)[-1].lower()]
    if not ggufs:
        raise ModelNotFoundError(f"{wanted.repo} holds neither a config.json nor a .gguf file; it is no model repo")
    tag = (wanted.quant or DEFAULT_QUANT).upper()
    tagged = [f for f in ggufs if re.search(rf"(^|[-_.]){re.escape(tag)}([-_.]|$)", f.rsplit("/", 1)[-1].upper())]
    if len(tagged) == 1:
        return tagged[0]
    if wanted.quant is None and len(ggufs) == 1:
        return ggufs[0]
    tags = sorted({quant_tag(f) for f in ggufs})
    raise ModelNotFoundError(
        f"{wanted.repo} has {'no' if not tagged else 'several'} {tag} file; pick one of its quantizations as "
        f"{wanted.repo}:TAG ({', '.join(tags)})"
    )


def quant_tag(filename: str) -> str:
    found = re.search(r"(I?Q\d\w*|F16|BF16|F32)", filename.rsplit("/", 1)[-1].upper().removesuffix(".GGUF"))
    return found.group(1) if found else filename


@contextlib.contextmanager
def hub_errors(repo: str):
    """Turns huggingface_hub's failures into one-line ModelNotFoundErrors that say what to do."""
    try:
        yield
    except ModelNotFoundError:
        raise
    except Exception as error:
        message = explained(error, repo)
        if message is None:
            raise
        raise ModelNotFoundError(message) from None


def explained(error: Exception, repo: str) -> str | None:
    """What went wrong with `repo`, in a line that says what to do; None for an error that is no hub failure."""
    from huggingface_hub import errors

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if isinstance(error, errors.GatedRepoError):
        return f"{repo} is gated: accept its terms on the Hub, then {TOKEN_HINT}"
    if isinstance(error, errors.RepositoryNotFoundError):
        return f"{repo} is not on the Hub, or is private: check the name, or {TOKEN_HINT}"
    if isinstance(error, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        return (
            f"{repo} is not in the Hugging Face cache and this machine is offline (HF_HUB_OFFLINE=1, or the Hub at "
            f"{endpoint} does not answer); `minimlx ls` lists what is downloaded"
        )
    if isinstance(error, (errors.EntryNotFoundError, errors.RevisionNotFoundError)):
        return f"{repo} has no such file or revision: {str(error).splitlines()[0]}"
    if isinstance(error, errors.HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        return f"the Hub at {endpoint} answered {status} for {repo}" + (
            f"; {TOKEN_HINT}" if status in (401, 403) else ""
        )
    if isinstance(error, OSError) or type(error).__module__.split(".")[0].startswith("httpx"):
        return f"could not reach the Hub at {endpoint} for {repo} ({type(error).__name__}); check the network"
    return None


@dataclass(frozen=True)
class Downloaded:
    """A repo in the Hugging Face cache: its id, bytes on disk, and its folder."""

    repo: str
    size: int
    path: Path


def downloaded(cache: Path) -> list[Downloaded]:
    """The model repos in the cache folder `cache`, by name."""
    repos = []
    for folder in sorted(cache.glob("models--*")):
        size = sum(blob.stat().st_size for blob in (folder / "blobs").glob("*") if blob.is_file())
        repos.append(Downloaded(folder.name.removeprefix("models--").replace("--", "/"), size, folder))
    return repos


def remove(cache: Path, repo: str) -> Downloaded:
    """Delete `repo` from the cache; what it held."""
    found = [entry for entry in downloaded(cache) if entry.repo == repo]
    if not found:
        raise ModelNotFoundError(f"{repo} is not in the Hugging Face cache ({cache}); `minimlx ls` lists what is")
    shutil.rmtree(found[0].path)
    return found[0]
