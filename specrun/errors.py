"""One exception family for everything a user can cause or fix.

The CLI turns a SpecrunError into a one-line message and its exit code; anything else is a bug
and gets a traceback only with --verbose.
"""


class SpecrunError(Exception):
    """A problem the user can act on: printed as one line, exit code 1."""

    exit_code = 1


class UsageError(SpecrunError):
    """Bad options or arguments: exit code 2, like a command-line parser's own errors."""

    exit_code = 2


class GrammarError(UsageError):
    """A grammar or JSON schema the grammar engine cannot follow: found when it is compiled, or
    only mid-answer (a limit of llguidance met by the text generated so far)."""


class ModelFileError(SpecrunError):
    """A model file is missing, unreadable or not a usable GGUF."""


class EngineError(SpecrunError):
    """llama.cpp refused an operation (decode failed, KV operation unsupported, ...)."""


class ContextFullError(EngineError):
    """The context window has no room for the tokens we need to decode."""


class RegistryError(UsageError):
    """Unknown alias, malformed models.toml, incompatible target/draft pair."""


class DownloadError(SpecrunError):
    """A model could not be fetched or failed verification."""
