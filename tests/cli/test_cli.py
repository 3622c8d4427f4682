"""The `llgraph` command as a user runs it: output on success, one line and exit 2 on bad input."""

import subprocess
import sys


def llgraph(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd)


def test_inspect_8b_reports_llama3_8b_size(tmp_path):
    r = llgraph("inspect", "--config", "8b.json", cwd=tmp_path)  # a bundled preset, from any directory
    print(r.stdout)
    assert r.returncode == 0, r.stderr
    assert "parameters: 8,030,261,248" in r.stdout
    assert "KV cache (float16): 131,072 bytes/token" in r.stdout  # 2 (k, v) * 32 layers * 8 heads * 128 * 2 B
    assert "GroupedAttention  32" in r.stdout and "RMSNorm           65" in r.stdout


def test_inspect_after_packing_shows_splits(tmp_path):
    r = llgraph("inspect", "--config", "tiny", "--passes", cwd=tmp_path)
    assert r.returncode == 0 and "Split             4" in r.stdout


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_layers": 1, '
                   '"num_heads": 4, "num_kv_heads": 3}')
    r = llgraph("inspect", "--config", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0
    assert "num_heads (4) must be divisible by num_kv_heads (3)" in r.stderr
    r = llgraph("inspect", "--config", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "neither a file nor a bundled preset" in r.stderr


def test_export_bundled_model_as_the_readme_says(tmp_path):
    r = llgraph("export", "--checkpoint", "smollm2", "-o", "smollm2-ort", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "smollm2-ort"
    assert {"model.onnx", "model.onnx.data", "manifest.json", "genai_config.json"} <= {p.name for p in out.iterdir()}
    assert "export ort" in r.stderr  # the progress bar
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-ort"]  # no temporary left behind


def test_export_errors_are_one_line_exit_2_and_leave_nothing(tmp_path):
    for args, message in ((["--config", "tiny", "--target", "tensorrt"], "unknown target 'tensorrt'"),
                          (["--config", "tiny", "--dtype", "int4"], "unknown dtype 'int4'"),
                          (["--config", "tiny", "--checkpoint", "missing.gguf"], "checkpoint missing.gguf does not"),
                          (["--config", "nope.json"], "neither a file nor a bundled preset")):
        r = llgraph("export", *args, "-o", "out", cwd=tmp_path)
        errors = [line for line in r.stderr.splitlines() if line.startswith("llgraph: error:")]
        assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr
        assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_closed_pipe_is_quiet():
    """`llgraph inspect ... | head -1`: the reader goes away before the writer is done; no traceback, exit 0. The
    read end is closed before llgraph has imported anything, so every write meets the closed pipe."""
    p = subprocess.Popen([sys.executable, "-m", "llgraph", "inspect", "--config", "8b.json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(30) == 0 and "Traceback" not in err, err


def test_serve_takes_the_weight_flags_its_backend_runs(tmp_path):
    """serve checks the weight flags against its backend's registration: the ort backend takes an accuracy level
    and llgraph's kernels (so a missing model is the error), the trt backend refuses them."""
    def serve(*args):
        r = subprocess.run([sys.executable, "-m", "llgraph", "serve", str(tmp_path / "nope"), *args],
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stderr.strip().splitlines()[-1]

    for flags in (["--accuracy-level", "4"], ["--kernels", "llgraph"]):
        code, line = serve(*flags)
        assert code == 2 and "does not exist" in line, (flags, line)
    code, line = serve("--accuracy-level", "4", "--backend", "trt")
    assert code == 2 and "--accuracy-level (4)" in line, line


def test_threads_are_checked_before_anything_loads(tmp_path):
    """--threads (generate, eval, serve; all through registry.open_runner): a positive count, for the CPU backends;
    one line, exit 2."""
    for command in (["generate", "--prompt", "hi"], ["serve"]):
        for flags, message in ((["--threads", "0"], "--threads (0) must be a positive number"),
                               (["--threads", "2", "--backend", "trt"], "a TensorRT engine runs on the GPU")):
            r = llgraph(command[0], str(tmp_path / "nope"), *command[1:], *flags, cwd=tmp_path)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (command, flags, r.stderr)


def test_diff_without_a_side_to_compare_says_so():
    """`llgraph diff MODEL` with neither --b nor --save would run side a and report nothing: one line, exit 2."""
    r = llgraph("diff", "tiny")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--b" in r.stderr and "--save" in r.stderr, r.stderr


def test_one_name_for_a_model_in_every_command(tmp_path):
    """'smollm2' and an export folder name a model wherever a config is read (inspect MODEL or --config, diff's
    refusal of a folder says what to pass instead); a file that is no config is not called bad JSON."""
    for args in (["inspect", "smollm2"], ["inspect", "--config", "smollm2"]):
        r = llgraph(*args, cwd=tmp_path)
        assert r.returncode == 0 and "30 layers, hidden 576" in r.stdout, (args, r.stderr)
    assert llgraph("export", "--config", "tiny", "-o", "tiny-ort", cwd=tmp_path).returncode == 0
    r = llgraph("inspect", "tiny-ort", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("model: tiny"), r.stderr
    r = llgraph("diff", "tiny-ort", "--b", "ort", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is an export folder" in r.stderr, r.stderr
    (tmp_path / "notes.md").write_text("# not a model\n")
    r = llgraph("export", "--checkpoint", "notes.md", "-o", "out", cwd=tmp_path)
    assert r.returncode == 2 and "neither a config (JSON) nor a checkpoint" in r.stderr, r.stderr
    r = llgraph("inspect", cwd=tmp_path)
    assert r.returncode == 2 and "llgraph inspect MODEL" in r.stderr, r.stderr


def test_generate_on_a_folder_that_is_no_model_says_only_that(tmp_path):
    """No "exporting ..." line first, no hint at a --config that generate does not have."""
    (tmp_path / "empty").mkdir()
    r = llgraph("generate", "empty", "--prompt", "hi", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "neither config.json nor" in lines[0], r.stderr
    assert "--config" not in lines[0] and "exporting" not in r.stderr


def test_a_mistyped_flag_is_one_line_naming_the_right_one(tmp_path):
    r = llgraph("generate", "smollm2", "--max-new-tokns", "5", "--prompt", "hi", cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--max-new-tokns" in lines[0] and "did you mean --max-new-tokens?" in lines[0], lines
    for args in (["expor", "--config", "tiny"], ["export", "--config", "tiny", "--quantize", "int3", "-o", "x"]):
        r = llgraph(*args, cwd=tmp_path)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--help" in r.stderr, r.stderr


def test_a_missing_extra_is_one_line_with_a_working_install_command():
    """serve without fastapi, lm-eval without the harness: one line naming packages pip can find (llgraph itself
    is not on PyPI, so `pip install 'llgraph[serve]'` would fail)."""
    for blocked, args, packages in (("fastapi", ["serve", "smollm2"], "pip install fastapi uvicorn prometheus-client"),
                                    ("lm_eval", ["lm-eval", "--tasks", "x"], "pip install lm-eval")):
        code = (f"import sys; sys.modules[{blocked!r}] = None; sys.argv = ['llgraph', *{args!r}]; "
                "from llgraph.runtime.cli import main; sys.exit(main())")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and packages in lines[0], (blocked, r.stderr)
        assert "llgraph[" not in lines[0]


def test_an_onnx_export_run_on_onnx_runtime_says_the_ort_target_is_faster(tmp_path):
    assert llgraph("export", "--config", "tiny", "--target", "onnx", "-o", "tiny-onnx", cwd=tmp_path).returncode == 0
    r = llgraph("generate", "tiny-onnx", "--tokens", "1,2,3", "--max-new-tokens", "2", cwd=tmp_path)
    said = [line for line in r.stderr.splitlines() if "--target ort" in line]
    assert r.returncode == 0 and len(said) == 1 and "--target onnx export" in said[0], r.stderr


def test_prompt_sources_are_exactly_one_and_readable(tmp_path):
    for args, message in ((["--prompt", "a", "--tokens", "1"], "exactly one of --prompt"),
                          (["--prompt-file", "missing.txt"], "cannot read --prompt-file missing.txt"),
                          (["--tokens", "1,2", "--system", "be brief"], "drop them with --tokens")):
        r = llgraph("generate", "smollm2", *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (args, r.stderr)


def test_serve_on_a_busy_port_says_so_before_loading():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = llgraph("serve", "smollm2", "--port", str(port))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "loading" not in r.stdout, r.stdout


def test_a_bad_gguf_is_one_line_exit_2_and_leaves_no_cache_entry(tmp_path):
    """Text, empty, truncated (inside the header and inside the tensors), a tensor claiming a huge dimension, and a
    config claiming one: each one line naming the file and the fix, exit 2, nothing in the cache."""
    import struct

    from reference import tiny, write_gguf

    from llgraph.checkpoint import random_weights

    good = tmp_path / "good.gguf"
    cfg = tiny(hidden_size=64, intermediate_size=128, head_dim=16)
    write_gguf(good, cfg, random_weights(cfg, seed=1), lambda i, name, x: __import__("gguf").GGMLQuantizationType.F32)
    data = good.read_bytes()

    def patched(key: bytes, offset: int, fmt: str, value: int) -> bytes:
        b = bytearray(data)
        struct.pack_into(fmt, b, b.index(key) + len(key) + offset, value)
        return bytes(b)

    bad = {"text.gguf": b"not a model at all\n", "empty.gguf": b"", "header.gguf": data[:200],
           "tensors.gguf": data[:len(data) // 2],
           "huge-tensor.gguf": patched(b"token_embd.weight", 4, "<Q", 1 << 40),  # its first dimension
           "huge-config.gguf": patched(b"llama.embedding_length", 4, "<I", 1 << 31)}  # the value after its type
    cache = tmp_path / "cache"
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        r = llgraph("generate", str(tmp_path / name), "--tokens", "1,2", "--max-new-tokens", "2",
                    "--cache-dir", str(cache))
        errors = [line for line in r.stderr.splitlines() if line.startswith("llgraph: error:")]
        print(name, errors)
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (name, r.stderr)
        assert name in errors[0] and ("not a readable GGUF" in errors[0] or "does not fit" in errors[0]), errors
        assert not [p for p in cache.glob("*") if p.is_dir() and p.name not in ("kernels", "ort-headers")], name


def test_an_export_the_disk_cannot_hold_is_refused_up_front(tmp_path, monkeypatch):
    """8B in fp32 is 32 GB: on a disk with 10 GB free, one line naming both sizes and the fix, nothing written."""
    import collections
    import shutil

    import pytest

    from llgraph.errors import LlgraphError
    from llgraph.export import export_model

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 90 << 30, 10 << 30))
    with pytest.raises(LlgraphError) as e:
        export_model("8b.json", out=tmp_path / "out")
    print(e.value)
    assert "needs about 32.12 GB" in str(e.value) and "10.74 GB free" in str(e.value) and "-o DIR" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_errors_name_the_flag_and_the_missing_keys(tmp_path):
    """`--top-p 2` names the flag the user typed, not the field; an empty config names the keys it lacks."""
    r = llgraph("generate", "smollm2", "--prompt", "hi", "--top-p", "2", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("llgraph: error: --top-p ") and "top_p" not in r.stderr, r.stderr
    (tmp_path / "empty.json").write_text("{}")
    r = llgraph("inspect", "--config", str(tmp_path / "empty.json"))
    print(r.stderr)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "lacks required key(s) vocab_size" in r.stderr
    assert "LlamaConfig" not in r.stderr
