"""User-facing errors: each message is one line naming the problem and the fix. The CLI prints them and exits 2;
any other exception is a bug and keeps its traceback."""


class LlgraphError(ValueError):
    pass


class ExportError(LlgraphError):
    """Bad export request (target, dtype, weight flags, output folder); one line naming the fix."""


class MissingExtra(LlgraphError):
    """An optional part of llgraph whose packages are not installed: one line naming them, installable as they are
    (llgraph itself is installed from its clone, so `pip install 'llgraph[extra]'` would not find it)."""

    def __init__(self, what: str, packages: str, extra: str, error: ImportError):
        super().__init__(f"{what} needs {packages} ({error.name or error}): pip install {packages} (or pip install "
                         f"-e '.[{extra}]' in llgraph's clone)")
