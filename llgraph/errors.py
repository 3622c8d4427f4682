"""User-facing errors: each message is one line naming the problem and the fix. The CLI prints them and exits 2;
any other exception is a bug and keeps its traceback."""


class LlgraphError(ValueError):
    pass


class RequestError(LlgraphError):
    """A request the engine cannot serve (generate, score, embed, a served request); one line naming the bad value."""


class ExportError(LlgraphError):
    """Bad export request (target, dtype, weight flags, output folder); one line naming the fix."""


class MissingExtra(LlgraphError):
    """An optional part of llgraph whose packages are not installed: one line naming them, installable as they are
    (llgraph itself is installed from its clone, so `pip install 'llgraph[extra]'` would not find it)."""

    def __init__(self, what: str, packages: str, extra: str, error: ImportError):
        how = f"pip install {packages}"
        if packages == "torch":  # an unpinned torch is a CUDA build of several GB
            how = "pip install torch --index-url https://download.pytorch.org/whl/cpu (a CPU build; plain `pip " \
                  "install torch` takes a CUDA one of several GB)"
        super().__init__(f"{what} needs {packages} ({error.name or error}): {how}, or in llgraph's clone pip install "
                         f"--config-settings editable_mode=strict -e '.[{extra}]'")


def described(e: BaseException) -> str:
    """An error as a request's or a row's message: a user-facing one as it is, any other with its type."""
    return str(e) if isinstance(e, LlgraphError) else f"{type(e).__name__}: {e}"
