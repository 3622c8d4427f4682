"""Models by Hub id (llgraph/hub.py), fetched by `huggingface_hub` itself from a local stand-in for the Hub
(tests/hub_server.py, HF_ENDPOINT): a GGUF by quantization tag, its download cut halfway and resumed; an HF repo
answering as its local folder does; the cache used offline; and one line, exit 2, for no network, an unknown repo,
a gated repo without a token, an unknown revision and a missing quantization."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need
from hub_server import TOKEN, Hub
from reference import tiny, write_hf_checkpoint
from test_first_hour import one_line_error

from llgraph.bundled import bundled_model
from llgraph.checkpoint import random_weights

need("huggingface_hub")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    gguf = root / "smollm2-gguf"
    gguf.mkdir()
    (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(bundled_model("smollm2"))
    (gguf / "README.md").write_text("a GGUF repo\n")
    hf = write_hf_checkpoint(root / "tiny-hf", tiny(), random_weights(tiny(), seed=11, std=0.25))
    twins = root / "twins"  # two files of one quantization: which one is meant cannot be guessed
    twins.mkdir()
    for name in ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct-imat-Q4_1.gguf"):
        (twins / name).symlink_to(bundled_model("smollm2"))
    server = Hub({"test-org/smollm2-gguf": gguf, "test-org/tiny-hf": hf, "test-org/gated": hf,
                  "test-org/twins": twins},
                 gated=("test-org/gated",), cut=("SmolLM2-135M-Instruct.Q4_1.gguf",))
    yield server, hf
    server.close()


def _env(tmp_path, url, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1",
            "TQDM_POSITION": "-1", **extra}


def llgraph(env, *args):
    return subprocess.run([sys.executable, "-m", "llgraph", *args], capture_output=True, text=True, env=env)


def test_a_gguf_by_quantization_tag_resumes_a_cut_download_then_works_offline(hub, tmp_path):
    server, _ = hub
    env = _env(tmp_path, server.url)
    r = llgraph(env, "inspect", "test-org/smollm2-gguf:q4_1")
    assert r.returncode == 0, r.stderr
    assert "parameters: 134,515,008" in r.stdout  # SmolLM2-135M's count, read from the downloaded file
    assert any(rng.startswith("bytes=") and rng != "bytes=0-" for rng in server.ranges), server.ranges  # resumed
    assert "fetching test-org/smollm2-gguf: SmolLM2-135M-Instruct.Q4_1.gguf from the Hub" in r.stderr
    assert "%|" in r.stderr  # huggingface_hub's progress bar (TQDM_POSITION=-1: shown off a terminal too)
    cached = next((tmp_path / "hf-home").rglob("SmolLM2-135M-Instruct.Q4_1.gguf"))
    want = hashlib.sha256(bundled_model("smollm2").read_bytes()).hexdigest()
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == want  # the bytes, whole, after the cut
    # offline, with the Hub gone: the cached copy, without a word to the network
    offline = _env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    r = llgraph(offline, "inspect", "test-org/smollm2-gguf:Q4_1")
    assert r.returncode == 0 and "parameters: 134,515,008" in r.stdout, r.stderr
    # no network and nothing cached: one line
    one_line_error(llgraph(_env(tmp_path, "http://127.0.0.1:9"), "inspect", "test-org/tiny-hf"),
                   "cannot be reached", "HF_HUB_OFFLINE")


def test_an_hf_repo_answers_as_its_local_folder(hub, tmp_path):
    from llgraph.runtime import open_runner

    server, folder = hub
    env = _env(tmp_path, server.url)
    r = llgraph(env, "generate", "test-org/tiny-hf", "--tokens", "1,5,9", "--max-new-tokens", "6")
    assert r.returncode == 0, r.stderr
    local = open_runner(str(folder), "torch").generate([1, 5, 9], 6)
    assert r.stdout.strip() == ",".join(map(str, local.token_ids)), (r.stdout, local.token_ids)


@pytest.mark.parametrize("args, extra_env, words", [
    (["inspect", "test-org/nothing-here"], {}, ["no model repo of that name", "HF_TOKEN"]),
    (["inspect", "test-org/gated"], {}, ["gated", "HF_TOKEN"]),
    (["generate", "test-org/tiny-hf", "--tokens", "1", "--revision", "v9"], {}, ["no revision 'v9'"]),
    (["inspect", "test-org/smollm2-gguf:Q6_K"], {}, ["no GGUF file of quantization Q6_K",
                                                      "SmolLM2-135M-Instruct.Q4_1.gguf"]),
    (["inspect", "test-org/twins:Q4_1"], {}, ["2 GGUF files of quantization Q4_1", "imat-Q4_1.gguf",
                                              "name one, e.g. test-org/twins:"]),
])
def test_hub_failures_are_one_line(hub, tmp_path, args, extra_env, words):
    server, _ = hub
    one_line_error(llgraph(_env(tmp_path, server.url, **extra_env), *args), *words)


def test_a_gated_repo_opens_with_a_token(hub, tmp_path):
    server, _ = hub
    r = llgraph(_env(tmp_path, server.url, HF_TOKEN=TOKEN), "generate", "test-org/gated", "--tokens", "1,5",
                "--max-new-tokens", "2", "--revision", server.commit("test-org/gated"))
    assert r.returncode == 0, r.stderr


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, hub):
    """An endpoint that resolves any revision and answers paths as commits and ETags (a mirror or proxy turned)."""
    _, hf = hub
    escape = "../../../../../../../../../../../../../../escaped"
    server = Hub({"test-org/tiny-hf": hf, "test-org/etag": hf, "test-org/commit": hf, "test-org/sha": hf,
                  "test-org/etag-word": hf},
                 any_revision=True, lies={"test-org/etag": {"etag": escape}, "test-org/commit": {"commit": escape},
                                          "test-org/sha": {"sha": escape},
                                          "test-org/etag-word": {"etag": "bl\u00f6b"}})  # a non-ASCII blob name
    yield server
    server.close()


@pytest.mark.parametrize("args, words", [
    (["generate", "test-org/tiny-hf@{victim}", "--tokens", "1"], ["is not a branch, tag or commit name"]),
    (["generate", "test-org/tiny-hf", "--revision", "../../../made", "--tokens", "1"], ["not a branch, tag"]),
    (["generate", "test-org/tiny-hf", "--revision", "../../../../../../../../../../../../../../../escaped",
      "--tokens", "1"], ["not a branch, tag"]),
    (["generate", "test-org/tiny-hf", "--revision", "/abs", "--tokens", "1"], ["not a branch, tag"]),
    (["generate", "test-org/etag", "--tokens", "1"], ["answered ETag", "HF_ENDPOINT"]),
    (["generate", "test-org/etag-word", "--tokens", "1"], ["answered ETag", "HF_ENDPOINT"]),
    (["generate", "test-org/commit", "--tokens", "1"], ["answered commit", "HF_ENDPOINT"]),
    (["generate", "test-org/sha", "--tokens", "1"], ["answered commit", "HF_ENDPOINT"]),
    (["inspect", "test-org/" + "x" * 3000], ["is not a Hub repo id"]),
    (["inspect", "test-org/tiny-hf@" + "r" * 3000], ["not a branch, tag"]),
])
def test_a_hostile_endpoint_or_id_writes_nothing_outside_the_cache(hostile, tmp_path, args, words):
    """A revision or an answer naming a path outside the Hub cache is refused in one line and writes nothing there
    (before: `@../../<dir>/victim.txt` overwrote the victim with a commit hash; `--revision ../X` created files)."""
    work = tmp_path / "work"
    work.mkdir()
    victim = work / "victim.txt"
    victim.write_text("precious\n")
    home = tmp_path / "hf-home"
    depth = len(home.parts) + 3  # enough `..` to leave the cache and reach the root
    args = [a.replace("{victim}", "../" * depth + str(victim).lstrip("/")) for a in args]
    before = _tree(tmp_path)
    r = llgraph(_env(tmp_path, hostile.url), *args)
    one_line_error(r, *words)
    after = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("hf-home/")}
    assert after == {k: v for k, v in before.items() if not k.startswith("hf-home/")}
    assert not any(p.name in ("escaped", "made") for p in tmp_path.rglob("*")) and not Path("/escaped").exists()
    assert victim.read_text() == "precious\n"


def test_what_killed_downloads_left_is_removed_unless_a_download_holds_it(hub, tmp_path):
    """`kill -9` during a download leaves `blobs/<etag>.<id>.incomplete` (huggingface_hub never resumes another
    process's file): `cache list` counts them, `cache clean` removes them — not one whose download still runs (its
    etag's lock held) — and the next download of their repo does too."""
    from filelock import FileLock

    server, _ = hub
    env = _env(tmp_path, server.url)
    blobs = tmp_path / "hf-home" / "hub" / "models--test-org--smollm2-gguf" / "blobs"
    blobs.mkdir(parents=True)
    dead, alive = blobs / "aaaa.0badc0de.incomplete", blobs / "bbbb.1badc0de.incomplete"
    dead.write_bytes(b"\0" * (3 << 20))
    alive.write_bytes(b"\0" * (1 << 20))
    locks = tmp_path / "hf-home" / "hub" / ".locks" / "models--test-org--smollm2-gguf"
    locks.mkdir(parents=True)
    with FileLock(locks / "bbbb.lock"):  # a download in another process, still running
        r = llgraph(env, "cache", "list", "--cache-dir", str(tmp_path / "cache"))
        assert "Hub downloads cut short: 1 files, 3 MiB" in r.stdout, r.stdout + r.stderr
        r = llgraph(env, "cache", "clean", "--cache-dir", str(tmp_path / "cache"))
        assert r.returncode == 0 and "removed 1 files Hub downloads cut short left, freed 3 MiB" in r.stdout, r.stdout
        assert not dead.exists() and alive.exists()
    r = llgraph(env, "inspect", "test-org/smollm2-gguf:Q4_1")  # the lock free now: the next download removes it
    assert r.returncode == 0 and "removed 1 MiB that 1 cut download of test-org/smollm2-gguf left" in r.stderr, \
        r.stderr
    assert not alive.exists()
