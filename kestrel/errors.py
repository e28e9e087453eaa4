"""One error type for everything a user can get wrong (STYLE.md rule 6)."""


class KestrelError(Exception):
    """A user-facing error: the message names the bad value and what would be accepted."""


class ModelLoadError(KestrelError):
    """A checkpoint directory that cannot be loaded (missing file, bad shape, unsupported architecture)."""
