"""vx's error types. The CLI maps them to exit codes in one place (vx/cli/__init__.py)."""


class VxError(Exception):
    """A runtime failure with a message meant for the user (exit code 1, no traceback)."""

    exit_code = 1


class UsageError(VxError):
    """Bad user input: a flag, a path, a layer id, a dataset line under --strict (exit code 2)."""

    exit_code = 2
