"""The core (llgraph/*.py) and the engine (runtime/engine/) type-check clean with mypy ([tool.mypy] in
pyproject.toml names the files and the settings)."""

import subprocess
import sys
from pathlib import Path

from conftest import need

REPO = Path(__file__).resolve().parents[2]


def test_the_core_and_the_engine_type_check():
    need("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=REPO)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success: no issues found" in r.stdout
