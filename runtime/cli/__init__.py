"""The `llgraph` command line: the top floor, above everything it drives (it may import any room of the runtime,
and export, plugins and the core below). `args.py` holds the parsers, `commands.py` one `cmd_*` per command (named
in its COMMANDS), `chat.py` the terminal conversation. Nothing below imports it."""

from llgraph.runtime.cli.commands import COMMANDS, main

__all__ = ["COMMANDS", "main"]
