"""User-facing errors: one line that names the file, tensor, field or flag and what was expected.

The CLI prints `error: <message>` and exits with code 2 for these; any other exception is a bug
and shows its traceback.
"""


class DsquantError(Exception):
    """An error the user can act on (bad path, bad checkpoint, bad flag)."""


class CheckpointError(DsquantError):
    """A checkpoint directory, shard or tensor is missing, truncated or malformed."""


class ConfigError(DsquantError):
    """A config.json, quantization_config or recipe field is missing or unsupported."""
