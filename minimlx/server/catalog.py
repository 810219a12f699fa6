"""The models a server knows by name: those given with --model, the folders and GGUF files of --models-dir, the
Hugging Face cache's repos (io/hub.py); which of them --allow-model lets through; and a request's `model` (as OpenAI,
Anthropic and Ollama clients write it, `name:latest` included) to one of them."""

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import MinimlxError
from ..io import hub
from .fields import APIError

WEIGHTS = ("*.safetensors", "*.gguf", "*.npz")


@dataclass(frozen=True)
class Known:
    """A model the server can load: the name requests use, what it was given as, and its folder or .gguf file."""

    name: str
    source: str
    path: Path

    @property
    def inputs(self) -> tuple[str, ...]:
        """What the model reads, known before it loads: text, and images where its folder's config has a vision
        tower (a .gguf file: text; its mmproj file is not looked for)."""
        config = self.path / "config.json"
        try:
            vision = config.is_file() and "vision_config" in json.loads(config.read_text())
        except (OSError, ValueError):
            vision = False
        return ("text", "image") if vision else ("text",)

    @property
    def disk_bytes(self) -> int:
        """Bytes of its weights on disk: what loading it is expected to take before it is loaded."""
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(p.stat().st_size for pattern in WEIGHTS for p in self.path.glob(pattern) if p.is_file())

    def answers_to(self, asked: str) -> bool:
        """Whether a request naming `asked` means this model: its name, what it was given as or the last part of
        that (a path's folder, a .gguf file's stem), with or without Ollama's `:latest`."""
        names = (self.name, self.source, Path(self.source).name.removesuffix(".gguf"))
        return asked in names or asked.removesuffix(":latest") in names


def path_of(source: str) -> Path:
    """The folder or file a model name stands for, without downloading; the name as a path where it stands for none
    that is here (a model handed over already loaded: tests, the Python API)."""
    from ..io.resolve import REPO_ID, resolve

    if REPO_ID.match(source) and hub.cached_snapshot(source) is None:
        return Path(source)
    try:
        return resolve(source)
    except MinimlxError:
        return Path(source)


def given(source: str, path: Path) -> Known:
    """A model given by name (a path, a repo id, a short name): a path goes by its last part (a .gguf file's stem)."""
    named_path = Path(source).expanduser().exists()
    return Known(Path(source).name.removesuffix(".gguf") if named_path else source, source, path)


def in_folder(folder: Path) -> list[Known]:
    """The checkpoint folders (with config.json) and .gguf files directly inside `folder`, by name."""
    found = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "config.json").is_file():
            found.append(Known(path.name, str(path), path))
        elif path.suffix == ".gguf" and "mmproj" not in path.name.lower():
            found.append(Known(path.stem, str(path), path))
    return found


def in_hub_cache() -> list[Known]:
    """The Hugging Face cache's model repos: a folder repo, or its GGUF files (`org/name:TAG` when it has several)."""
    found = []
    for entry in hub.downloaded(hub.hub_cache()):
        snapshot = hub.cached_snapshot(entry.repo)
        if snapshot is None:
            continue
        if (snapshot / "config.json").is_file():
            found.append(Known(entry.repo, entry.repo, snapshot))
            continue
        ggufs = sorted(p for p in snapshot.rglob("*.gguf") if "mmproj" not in p.name.lower())
        for path in ggufs:
            name = entry.repo if len(ggufs) == 1 else f"{entry.repo}:{hub.quant_tag(path.name)}"
            found.append(Known(name, name, path))
    return found


class Catalog:
    """The known models a request may name. `allow` (fnmatch patterns of names or sources) keeps the others out:
    they are not listed, and a request naming one is refused (403). With `any_name`, a server of one model answers
    whatever name a request gives (serve without --served-model-name); else an unknown name is a 404."""

    def __init__(self, models: list[Known], allow: tuple[str, ...] = (), any_name: bool = False):
        self.all, self.allow, self.any_name = dedup(models), allow, any_name
        self.models = [known for known in self.all if self.allowed(known)]

    def allowed(self, known: Known) -> bool:
        return not self.allow or any(fnmatch.fnmatchcase(n, p) for p in self.allow for n in (known.name, known.source))

    def named(self, asked, strict: bool = False) -> Known:
        """The model a request's `model` names (None or, unless `strict`, any name: the first, for a server of one
        model)."""
        if not strict and (asked is None or (self.any_name and len(self.models) == 1)):
            if not self.models:
                raise APIError(404, "this server has no model to answer with", "model", "model_not_found")
            return self.models[0]
        found = next((k for k in self.all if isinstance(asked, str) and k.answers_to(asked)), None)
        found = found or next((k for k in self.all if k.name.split(":")[0] == asked), None)  # org/name of org/name:TAG
        if found is None:
            names = ", ".join(k.name for k in self.models[:20]) or "none"
            message = f"the model '{asked}' is not served here; /v1/models (or /api/tags) lists them: {names}"
            raise APIError(404, message, "model", "model_not_found", kind="not_found_error")
        if not self.allowed(found):
            message = f"the model '{asked}' is not allowed on this server (--allow-model {' '.join(self.allow)})"
            raise APIError(403, message, "model", "model_not_allowed", kind="permission_error")
        return found


def dedup(models: list[Known]) -> list[Known]:
    """Each name once: the first model given under it (--model before --models-dir before the cache)."""
    seen: dict[str, Known] = {}
    for known in models:
        seen.setdefault(known.name, known)
    return list(seen.values())
