"""A new user's first hour (issue 15): bf16 refused up front where it cannot run, imports from any folder, the export
cache keyed on content and listable/cleanable, flags checked before anything loads, HF config typos warned about,
--version, generate --tokens, help on every flag."""

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from reference import tiny, write_hf_checkpoint

from llgraph.checkpoint import random_weights
from llgraph.errors import LlgraphError
from llgraph.export import export_model
from llgraph.runtime.backends.export_cache import content_key, entries
from llgraph.runtime.cli.parser import build_parser
from llgraph.weight_request import Weights

REPO = Path(__file__).resolve().parents[2]


def llgraph(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def one_line_error(r, *words):
    errors = [line for line in r.stderr.splitlines() if line.startswith("llgraph: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in errors[0], errors[0]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny HF-style checkpoint folder (config.json + model.safetensors, no tokenizer)."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), tiny(), random_weights(tiny(), seed=11, std=0.25))


# -- bf16 --------------------------------------------------------------------------------------------------------------

def test_bf16_for_onnx_runtime_is_refused_up_front(tmp_path):
    r = llgraph("export", "--config", "tiny", "--dtype", "bf16", "-o", "out", cwd=tmp_path)
    one_line_error(r, "--dtype bf16 cannot run on the ort target", "fp32 or fp16")
    assert list(tmp_path.iterdir()) == []
    folder = export_model("tiny", out=tmp_path / "onnx-bf16", target="onnx",
                          weights=Weights("bf16"))  # for a GPU runtime
    r = llgraph("generate", str(folder), "--tokens", "1,2,3", "--max-new-tokens", "2")
    one_line_error(r, "bf16 export", "no bf16 MatMul", "--dtype fp32")


# -- imports ---------------------------------------------------------------------------------------------------------

def test_imports_work_from_a_folder_holding_a_folder_named_llgraph(tmp_path):
    """The clone is usually named `llgraph`; run from its parent, that folder must not shadow the package."""
    (tmp_path / "llgraph").mkdir()
    code = "import llgraph.export, llgraph.runtime, llgraph.plugins, llgraph; print(llgraph.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = llgraph("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("llgraph ")


@pytest.mark.slow
def test_imports_from_a_built_wheel(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                        str(REPO)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("llgraph-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "llgraph/export/lower.py" in names and "llgraph/configs/tiny.json" in names
    assert not [n for n in names if n.split("/")[0] in ("export", "runtime", "plugins", "tests")]
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    (tmp_path / "cwd" / "llgraph").mkdir(parents=True)
    code = ("import llgraph.export, llgraph.runtime, llgraph.checkpoint as c; print(llgraph.export.__file__); "
            "print(c.load_config('tiny').num_layers)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path / "cwd",
                       env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(tmp_path / "site")) and r.stdout.splitlines()[1] == "2"


# -- the export cache ------------------------------------------------------------------------------------------------

def test_cache_key_is_the_content_not_the_path_or_mtime(tiny_ckpt, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    os.utime(copy / "model.safetensors", (1, 1))
    key = content_key(tiny_ckpt, tmp_path / "cache", "ort", "float32")
    assert content_key(copy, tmp_path / "cache", "ort", "float32") == key  # another path, another mtime
    assert content_key(copy, tmp_path / "cache", "ort", "float16") != key
    with open(copy / "model.safetensors", "r+b") as f:  # one changed byte
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert content_key(copy, tmp_path / "cache", "ort", "float32") != key


def test_an_entry_on_llgraph_s_kernels_is_keyed_on_their_sources(tiny_ckpt, tmp_path, monkeypatch):
    """A kernel change is never served by an entry that carries the old build (each export copies its kernels)."""
    from llgraph.plugins import cpu
    from llgraph.runtime.backends.export_cache import entry_for

    own, standard = "float32-stored-lauto-kllgraph", "float32-stored-lauto"
    before = entry_for(tiny_ckpt, tmp_path, "ort", own), entry_for(tiny_ckpt, tmp_path, "ort", standard)
    monkeypatch.setattr(cpu, "source_key", lambda: "0123456789abcdef")
    after = entry_for(tiny_ckpt, tmp_path, "ort", own), entry_for(tiny_ckpt, tmp_path, "ort", standard)
    assert after[0] != before[0] and after[1] == before[1]
    # the older entry is named, never removed: an export under the new key lists it for `cache clean`
    from llgraph.runtime.backends.export_cache import superseded

    for entry in (before[0], before[1]):
        entry.mkdir()
        (entry / "manifest.json").write_text("{}")
    assert superseded(after[0]) == [before[0]] and before[0].exists()


def test_cache_list_clean_env_and_flag(tiny_ckpt, tmp_path):
    cache = tmp_path / "cache"
    r = llgraph("generate", str(tiny_ckpt), "--tokens", "1,2,3", "--max-new-tokens", "4", "--cache-dir", str(cache))
    assert r.returncode == 0 and "exporting" in r.stderr, r.stderr
    ids = [int(t) for t in r.stdout.strip().split(",")]
    assert len(ids) == 4  # a checkpoint with no tokenizer answers in token ids
    copy = tmp_path / "reinstalled"
    shutil.copytree(tiny_ckpt, copy)
    r = llgraph("generate", str(copy), "--tokens", "1,2,3", "--max-new-tokens", "4",
                env={"LLGRAPH_CACHE_DIR": str(cache)})
    assert r.returncode == 0 and "exporting" not in r.stderr  # the same content reuses the entry
    assert [int(t) for t in r.stdout.strip().split(",")] == ids
    [entry] = entries(cache)
    r = llgraph("cache", "list", env={"LLGRAPH_CACHE_DIR": str(cache)})
    assert r.returncode == 0 and entry.name in r.stdout and "safetensors" in r.stdout and "MiB" in r.stdout
    r = llgraph("cache", "clean", "nope", "--cache-dir", str(cache))
    one_line_error(r, "no cache entry nope")
    r = llgraph("generate", str(tiny_ckpt), "--prompt", "Hello", "--cache-dir", str(cache))  # text, no tokenizer
    one_line_error(r, "--tokens 1,2,3")
    assert "Traceback" not in r.stderr, r.stderr
    (cache / "notes.txt").write_text("mine")
    r = llgraph("cache", "clean", "--cache-dir", str(cache))
    assert r.returncode == 0 and "removed 1 entries" in r.stdout
    assert sorted(p.name for p in cache.iterdir()) == ["notes.txt"]  # only llgraph's entries go


# -- flags checked before anything loads -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--top-p", "2"], "--top-p (2.0) must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature (-1.0) must be >= 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens (-5) must be at least 1"),
    (["--max-seq-len", "-7"], "--max-seq-len (-7) must be at least 2"),
    (["--max-seq-len", "0"], "--max-seq-len (0) must be at least 2"),
    (["--max-seq-len", "16", "--max-new-tokens", "16"], "raise --max-seq-len"),
    (["--tokens", "1,x"], "--tokens '1,x' must be comma-separated token ids"),
    (["--dtype", "bf16"], "--dtype bf16 cannot run on the ort target"),
    (["--accuracy-level", "7"], "--accuracy-level (7) is MatMulNBits' (0..4)"),
    (["--quantize", "int4", "--block-size", "48"], "--block-size (48) must be a power of 2"),
    (["--quantize", "int4", "--dequantize"], "--quantize and --dequantize contradict each other"),
])
def test_generate_flags_fail_before_loading(args, message, tmp_path):
    cache = tmp_path / "cache"
    base = ["generate", "smollm2", "--cache-dir", str(cache)]
    r = llgraph(*base, *(args if "--tokens" in args else ["--prompt", "hi", *args]))
    one_line_error(r, message)
    assert not cache.exists()  # nothing was exported


def test_context_errors_name_max_seq_len(tmp_path):
    folder = export_model("tiny", out=tmp_path / "ort", max_seq_len=64)
    r = llgraph("generate", str(folder), "--tokens", "1,2,3", "--max-seq-len", "20000")
    one_line_error(r, "--max-seq-len (20000) exceeds this export's RoPE range (64 positions)",
                   "llgraph export --max-seq-len 20000")
    r = llgraph("generate", str(folder), "--tokens", ",".join(["1"] * 60), "--max-new-tokens", "10")
    one_line_error(r, "exceeds the cache (64 tokens)", "raise --max-seq-len")


def test_missing_checkpoint_is_named_as_such(tmp_path):
    r = llgraph("export", "--checkpoint", str(tmp_path / "model.gguf"), "-o", "out", cwd=tmp_path)
    one_line_error(r, "--checkpoint", "does not exist")


# -- configs ---------------------------------------------------------------------------------------------------------

def test_hf_config_typo_is_warned_about_with_the_closest_key():
    from llgraph.hf_config import ConfigWarning, from_hf_dict

    d = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_beams": 1}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_hf_dict(d)  # every key known to llgraph or documented by transformers: silent
    with pytest.warns(ConfigWarning, match="'num_key_value_head' is unknown.*did you mean 'num_key_value_heads'"):
        from_hf_dict({**d, "num_key_value_head": 2})


def test_llgraph_json_keeps_refusing_unknown_keys(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({**tiny().to_dict(), "num_kv_head": 2}))
    r = llgraph("inspect", "--config", str(bad))
    one_line_error(r, "unknown config key(s) num_kv_head")


# -- small things ----------------------------------------------------------------------------------------------------

def test_version_help_and_dtype_names():
    r = llgraph("--version")
    from llgraph import __version__
    assert r.returncode == 0 and r.stdout.strip() == f"llgraph {__version__}"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"llgraph {name} {action.option_strings or action.dest} has no help text"
    assert llgraph("inspect", "--config", "tiny", "--dtype", "fp16").returncode == 0
    one_line = llgraph("inspect", "--config", "tiny", "--dtype", "int3")
    assert one_line.returncode == 2 and "unknown dtype 'int3'" in one_line.stderr


def test_generate_tokens_on_a_random_weight_export(tmp_path):
    folder = export_model("tiny", out=tmp_path / "ort")
    r = llgraph("generate", str(folder), "--tokens", "5,6,7", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().split(",")) == 3


def test_ort_runner_on_a_folder_without_manifest(tmp_path):
    from llgraph.runtime import ORTRunner

    with pytest.raises(LlgraphError, match="not an llgraph export folder"):
        ORTRunner(tmp_path)


def test_the_readme_python_example_imports_without_torch():
    """The README's Python block is for the first command's install, which has no torch: its imports hold with torch
    made unimportable (before: `from llgraph.runtime import ... TorchRunner` needed it)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S)[1]
    imports = "\n".join(line.split("#")[0] for line in block.splitlines() if line.startswith(("from ", "import ")))
    assert "open_runner" in imports
    r = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None\n" + imports],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_random_weights_say_their_size_and_tens_of_gb_want_yes(tmp_path):
    """`llgraph export --config 8b` without --checkpoint: the size is said first; 32 GB are not written by a script
    without --yes (before: written with one size line and no other word)."""
    r = subprocess.run([sys.executable, "-m", "llgraph", "export", "--config", "8b", "-o", str(tmp_path / "8b")],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    print(r.stderr)
    assert "seeded random weights (seed 0), about 32.1 GB, into" in r.stderr
    one_line_error(r, "pass --yes")
    assert not (tmp_path / "8b").exists()
    r = subprocess.run([sys.executable, "-m", "llgraph", "export", "--config", "tiny", "-o", str(tmp_path / "t")],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr  # small: written without asking, its size said once, with its folder's name
    assert r.stderr.count("GB") == 1 and f"about 0.00 GB of weights into {tmp_path / 't'}" in r.stderr, r.stderr


def test_perplexity_answers_with_named_fields(tiny_ckpt):
    from llgraph.runtime import open_runner

    got = open_runner(str(tiny_ckpt), "ort").perplexity([1, 5, 9, 4, 2])
    assert got.tokens == 4 and abs(got.perplexity - math.exp(got.nll / got.tokens)) < 1e-9
    ppl, nll, n = got  # and it unpacks as before
    assert (ppl, nll, n) == tuple(got)


def test_the_readme_test_command_takes_torch_s_cpu_build_first_and_help_says_true_defaults():
    """The README's second command installs torch's CPU build before the test extra (an unpinned torch pulled 7.2 GB
    of CUDA libraries on a machine without a GPU); --accuracy-level's help names its real default (it said 0)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = next(line for line in readme.splitlines() if '".[onnx,test]"' in line and "pytest" in line)
    assert command.index("download.pytorch.org/whl/cpu") < command.index('".[onnx,test]"'), command
    r = subprocess.run([sys.executable, "-m", "llgraph", "export", "--help"], capture_output=True, text=True)
    assert "default: by format" in " ".join(r.stdout.split()), r.stdout
