"""Errors that reach the user as one clear line (the CLI/TUI print `str(err)`, no traceback)."""


class NinferError(Exception):
    """Base class: the message is one line that says what went wrong and what to do."""


class ModelFileError(NinferError):
    """The model file is missing, truncated, corrupt, or uses something we do not support."""


class ConfigError(NinferError):
    """An option or config value is invalid (names the option and the accepted values)."""


class InputError(NinferError):
    """User input is invalid: a bad messages file, invalid UTF-8, a prompt longer than the context."""


class BackendUnavailable(NinferError):
    """A requested backend (e.g. cuda) cannot run here; the message says why."""
