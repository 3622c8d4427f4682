"""The floors run one way: core < plugins < export < runtime < CLI. Every import in llgraph's four folders is
scanned (function-level ones too: a lazy import is still a dependency; tests/imports.py)."""

import subprocess
import sys

from imports import circles, edges, floor, modules, upward


def test_no_import_circles():
    found = circles(edges())
    print(f"{len(modules())} modules, {len(found)} circles")
    assert not found, found


def test_no_import_runs_up_a_floor():
    found = upward(edges())
    print(f"{len(found)} upward imports")
    assert not found, [f"{a} ({floor(a)}) imports {b} ({floor(b)})" for a, b in found]


def test_the_scan_sees_a_planted_circle_and_an_upward_import():
    """The scanner itself: a graph with both faults is reported (so an empty report means something)."""
    runner = "llgraph.runtime.engine.runner"
    planted = {"llgraph.config": {"llgraph.weights"}, "llgraph.weights": {"llgraph.config", runner}, runner: set()}
    assert circles(planted) == [["llgraph.config", "llgraph.weights"]]
    assert upward(planted) == [("llgraph.weights", runner)]
    assert [floor(m) for m in ("llgraph.runtime.cli.args", "llgraph.export_folder", "llgraph.export.ort",
                               "llgraph.plugins.tensorrt.qdp", "llgraph.runtime.engine.step",
                               "llgraph.runtime.backends.trt", "llgraph.runtime.serve.app", "llgraph.__main__")] == \
        ["cli", "core", "export", "plugins", "engine", "backends", "apps", "cli"]
    assert {"llgraph.runtime.engine.step", "llgraph.runtime.cli"} <= set(modules())  # the rooms are scanned


def test_the_command_line_starts_without_torch():
    """`llgraph --help`, `--version` and a config's reading load no tensor library."""
    code = ("import sys, llgraph.runtime.cli, llgraph.checkpoint as c; c.load_config('tiny'); "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
