"""Output folders: `--force` replaces only an earlier llgraph export, never a user's files; SIGTERM leaves nothing
behind; a partial folder from a killed run is removed by the next run. Every refusal is one line and exit 2."""

import os
import signal
import subprocess
import sys
import time

import pytest

from llgraph.export import export_model
from llgraph.outdir import PARTIAL_MARK, OutputError


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_force_dot_refuses_and_keeps_every_file(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1")
    before = tree(tmp_path)
    r = llgraph("export", "--config", "tiny", "--force", "-o", ".", cwd=tmp_path)
    one_line_error(r, "current directory")
    r = llgraph("export", "--config", "tiny", "--force", "-o", "..", cwd=tmp_path / "src")
    one_line_error(r, "ancestor of the current directory")
    assert tree(tmp_path) == before


def test_force_refuses_a_folder_llgraph_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = llgraph("export", "--config", "tiny", "--force", "-o", str(out))
    one_line_error(r, "not an llgraph export", "--force will not replace it")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial folder either


def test_force_on_a_file_is_one_line(tmp_path):
    f = tmp_path / "model.onnx"
    f.write_text("mine")
    r = llgraph("export", "--config", "tiny", "--force", "-o", str(f))
    one_line_error(r, "is not a folder")
    assert f.read_text() == "mine"


@pytest.mark.parametrize("where", ["home", "root"])
def test_force_refuses_home_and_root(where, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("HOME", str(tmp_path))
    target = tmp_path if where == "home" else Path("/")
    with pytest.raises(OutputError, match="home|root|ancestor"):
        export_model("tiny", out=target, force=True)


def test_force_replaces_only_an_earlier_export(tmp_path):
    out = export_model("tiny", out=tmp_path / "out")
    with pytest.raises(OutputError, match="earlier llgraph export; pass --force"):
        export_model("tiny", out=out)
    (out / "engine.json").write_text('{"engine": "model.engine"}')  # what `llgraph build` adds is llgraph's too
    (out / "model.engine").write_bytes(b"engine")
    export_model("tiny", out=out, force=True, seed=1)
    assert not (out / "model.engine").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old tree was removed after the rename
    (out / "notes.txt").write_text("mine")  # a user's file inside an export: --force must not take it
    with pytest.raises(OutputError, match=r"files llgraph did not write \(notes.txt\)"):
        export_model("tiny", out=out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.onnx").exists()


def test_refusal_comes_before_any_loading(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = llgraph("export", "--checkpoint", str(tmp_path / "missing.gguf"), "--config", "tiny", "-o", str(out))
    one_line_error(r, "not empty")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_mid_export_leaves_nothing(sig, tmp_path):
    """An export of SmolLM2-sized random weights is killed once its partial folder appears."""
    proc = subprocess.Popen([sys.executable, "-m", "llgraph", "export", "--config", "smollm2-135m", "-o", "out"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.partial-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert list(tmp_path.glob(".out.partial-*")), "the export never started writing"
    time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"terminated by {signal.Signals(sig).name}" in err
    assert list(tmp_path.iterdir()) == [], tree(tmp_path)


def test_stale_partial_of_a_killed_run_is_removed(tmp_path, capfd):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # that process has exited: its PID is not alive
    stale = tmp_path / f".out.partial-{pid}"
    stale.mkdir()
    (stale / PARTIAL_MARK).touch()
    (stale / "model.onnx.data").write_bytes(b"\0" * 1024)
    unmarked = tmp_path / f".out.partial-{pid + 1}"  # not marked as llgraph's: never touched
    unmarked.mkdir()
    export_model("tiny", out=tmp_path / "out")
    assert not stale.exists() and unmarked.exists() and (tmp_path / "out" / "model.onnx").exists()
    assert f"removed {stale}" in capfd.readouterr().err
    assert os.getpid() != pid
