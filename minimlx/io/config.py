"""Reading a checkpoint folder's `config.json` (plugins turn it into their config dataclass)."""

import json
from pathlib import Path

from ..errors import CheckpointError, ModelNotFoundError


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).exists():
        raise ModelNotFoundError(f"no such model folder: {folder}")
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; point at a Hugging Face checkpoint folder or a .gguf file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from None
