"""Prefix reuse: a cache row's positions 0..n-1 hold the keys and values of the tokens written there, valid for any
continuation of them, so a prompt that starts the same way need not compute them again. The loop computes a batch's
shared prefix once (`shared_prefix`); the scheduler keeps what each slot's row holds (`CachedRows`)."""

from __future__ import annotations

from llgraph.runtime.engine.backend import Backend

MIN_REUSE = 8  # prompt tokens a cached prefix must cover to be copied between rows rather than computed again


def common_prefix(a, b, limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit`."""
    n, limit = 0, min(limit, len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def shared_prefix(prompts: list[list[int]]) -> int:
    """The leading tokens every prompt shares, short of the shortest prompt's last (a prefill must input at least
    one token per row to predict from)."""
    limit = min(map(len, prompts)) - 1
    return min(common_prefix(prompts[0], p, limit) for p in prompts)


class CachedRows:
    """The tokens each cache row holds at positions 0.. (kept after its request leaves), and the rows admitted but
    not yet prefilled (about to change: never a source)."""

    def __init__(self, backend: Backend, rows: int, enabled: bool = True):
        self.backend, self.enabled = backend, enabled
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.pending: set[int] = set()

    def holds(self, row: int, ids: list[int]) -> int:
        """How many leading prompt tokens the row holds (at most all but the last): 0 where a windowed layer's ring
        no longer holds the window behind them (Backend.keeps_prefix)."""
        n = common_prefix(self.held[row], ids, len(ids) - 1)
        return n if self.backend.keeps_prefix(row, n) else 0

    def place(self, ids: list[int], free: list[int]) -> int:
        """The free row holding the longest prefix of `ids`, else the lowest (decode steps cover as few rows as they
        can); it is pending until `reuse` is called for it."""
        row = max(free, key=lambda s: (0 if s in self.pending else self.holds(s, ids), -s))
        self.pending.add(row)
        return row

    def reuse(self, row: int, ids: list[int], allowed: bool = True) -> int:
        """Puts the longest cached prefix of `ids` in `row` (its own, or one copied from another row: a finished
        request's or a running one's) -> the positions it need not prefill; the row then holds that prefix (the
        engine's steps extend it as they write: Engine.update)."""
        self.pending.discard(row)
        length = 0
        if self.enabled and allowed:
            sources = [s for s in range(len(self.held)) if s == row or s not in self.pending]
            length, source = max((self.holds(s, ids), s == row, s) for s in sources)[::2]
            if source != row and (length < MIN_REUSE or not self.backend.copy_prefix(source, row, length)):
                length = self.holds(row, ids)
        self.held[row] = list(ids[:length])
        return length

    def forget(self, row: int) -> None:
        """The row holds nothing reusable (its request failed mid-write)."""
        self.held[row] = []
        self.pending.discard(row)
