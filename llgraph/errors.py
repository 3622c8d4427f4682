"""User-facing errors: each message is one line naming the problem and the fix. The CLI prints them and exits 2;
any other exception is a bug and keeps its traceback."""


class LlgraphError(ValueError):
    pass


class ExportError(LlgraphError):
    """Bad export request (target, dtype, weight flags, output folder); one line naming the fix."""
