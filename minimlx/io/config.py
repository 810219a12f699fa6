"""Reading a checkpoint folder's JSON files: `config.json` (plugins turn it into their config dataclass) and
the side files (tokenizer_config.json, generation_config.json, the shard index) through one reader."""

import json
from pathlib import Path

from ..errors import CheckpointError, ModelNotFoundError


def read_json(path: Path, missing: dict | None = None) -> dict:
    """The JSON object in `path` (`missing` when there is no such file); CheckpointError when it cannot be read
    or holds something else than an object."""
    if missing is not None and not path.is_file():
        return missing
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(value).__name__}; re-download the checkpoint")
    return value


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).exists():
        raise ModelNotFoundError(f"no such model folder: {folder}")
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; point at a Hugging Face checkpoint folder or a .gguf file")
    return read_json(path)
