"""One exception type per user-facing failure family.

Every message says what went wrong and what to do about it; the CLI prints it as one line
and exits with status 2.
"""


class MinimlxError(Exception):
    """A problem with what the user asked for (not a bug in minimlx)."""


class ModelNotFoundError(MinimlxError):
    """The named model (folder, file, repo id or short name) could not be found."""


class UnsupportedArchitectureError(MinimlxError):
    """The checkpoint's `model_type` (or GGUF architecture) has no registered plugin."""


class CheckpointError(MinimlxError):
    """The checkpoint's files disagree with its config: missing, unexpected or misshapen tensors, unreadable files."""


class InvalidSettingError(MinimlxError):
    """A setting is out of range (sampling parameters, dtype, device, prompt length); `field` names the setting
    when one is to blame (the server's 400 names the request field it came from)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFullError(MinimlxError):
    """The decode engine already holds as many waiting sequences as it was told to."""


class PromptTooLongError(InvalidSettingError):
    """The prompt leaves no room in the model's context for an answer."""


class PromptCacheError(MinimlxError):
    """A prompt cache file cannot be used: unreadable, damaged, or made by another model."""


class DataError(MinimlxError):
    """A training or validation data set cannot be used: a missing folder or split, a malformed record (named by its
    file and line), a record with nothing to train on."""
