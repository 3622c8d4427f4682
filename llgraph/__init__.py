"""llgraph: a declarative graph compiler for Llama-family decoders."""

__version__ = "0.1.0"
