"""The core (llgraph/*.py), the engine (runtime/engine/), the backends, the server and export type-check clean with
mypy, unannotated bodies too ([tool.mypy] in pyproject.toml names the files and the settings)."""

import subprocess
import sys
from pathlib import Path

from conftest import need

REPO = Path(__file__).resolve().parents[2]


def test_the_core_engine_backends_server_and_export_type_check():
    need("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=REPO)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout
