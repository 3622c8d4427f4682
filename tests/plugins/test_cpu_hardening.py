"""llgraph's CPU kernels trust no graph (issue 52): every input's size is checked against the node's shapes before a
byte is read — scales, mins, bias, residual and norm weight of QLinear, QEmbedding's scales and mins — and a graph
that disagrees fails the node with a message naming the input (before: an out-of-bounds read). The source builds
clean under -Wall -Wextra, and the kernel tests pass with the library built under AddressSanitizer and
UndefinedBehaviorSanitizer (every read and write in bounds, no undefined arithmetic)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import need

from llgraph.plugins import cpu

ort = need("onnxruntime")
onnx = need("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


@pytest.fixture(scope="module")
def library():
    path = cpu.library()
    assert path is not None, cpu.why_not()
    return path


def _run(library, op: str, given: dict, feed: dict, **attrs):
    inits = [numpy_helper.from_array(v, k) for k, v in given.items() if v is not None]
    names = [*feed] + [k if v is not None else "" for k, v in given.items()]
    while names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["y"], domain="llgraph", **attrs)
    inputs = [helper.make_tensor_value_info(k, TensorProto.INT64 if v.dtype == np.int64 else TensorProto.FLOAT,
                                            list(v.shape)) for k, v in feed.items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("llgraph", 1)])
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts).run(None, feed)[0]


N, NB, B, M = 37, 4, 32, 3  # 37 rows: 3 groups of 16 on the interleaved layout
GROUPS = 3


def _qlinear_inputs(rng):
    codes = rng.integers(0, 256, size=(GROUPS, NB, 16 * B // 2)).astype(np.uint8)
    return {"codes": codes, "scales": np.ones((GROUPS, NB, 16), np.float32) * 0.01,
            "mins": np.zeros((GROUPS, NB, 16), np.float32), "bias": np.zeros(N, np.float32),
            "residual": np.zeros((1, M, N), np.float32), "norm": np.ones(NB * B, np.float32)}


@pytest.mark.parametrize("name, bad, want", [
    ("scales", np.ones((GROUPS, NB, 15), np.float32), GROUPS * NB * 16),
    ("scales", np.ones((1, NB, 16), np.float32), GROUPS * NB * 16),
    ("mins", np.zeros((GROUPS, NB - 1, 16), np.float32), GROUPS * NB * 16),
    ("bias", np.zeros(N - 1, np.float32), N),
    ("residual", np.zeros((1, M - 1, N), np.float32), M * N),
    ("norm", np.ones(NB * B // 2, np.float32), NB * B),
    ("scales", np.ones((GROUPS, NB, 16), np.float64), None),  # float64 read as float32 would be garbage
])
def test_a_qlinear_input_of_the_wrong_size_fails_the_node(library, name, bad, want):
    rng = np.random.default_rng(0)
    given = _qlinear_inputs(rng)
    x = rng.standard_normal((1, M, NB * B)).astype(np.float32)
    attrs = dict(bits=4, block_size=B, zero_point=8, interleave=16, rows=N, epsilon=1e-5)
    whole = _run(library, "QLinear", given, {"x": x}, **attrs)
    assert whole.shape == (1, M, N) and np.isfinite(whole).all()
    with pytest.raises(Exception) as e:
        _run(library, "QLinear", {**given, name: bad}, {"x": x}, **attrs)
    print(str(e.value).splitlines()[-1][-160:])
    assert f"llgraph QLinear: {name}" in str(e.value)
    if want is not None:
        assert f"holds {bad.size} values where the node's shapes need {want}" in str(e.value)


def test_a_qembedding_input_of_the_wrong_size_fails_the_node(library):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(GROUPS, NB, 16 * B // 2)).astype(np.uint8)
    ids = np.array([[0, 5, 36]], np.int64)
    attrs = dict(bits=4, block_size=B, zero_point=8, rows=N)
    good = {"codes": codes, "scales": np.ones((GROUPS, NB, 16), np.float32), "mins": None}
    assert _run(library, "QEmbedding", good, {"ids": ids}, **attrs).shape == (1, 3, NB * B)
    for name, bad in (("scales", np.ones((GROUPS - 1, NB, 16), np.float32)),
                      ("mins", np.ones((GROUPS, NB, 8), np.float32))):
        with pytest.raises(Exception, match=f"llgraph QEmbedding: {name} holds"):
            _run(library, "QEmbedding", {**good, name: bad}, {"ids": ids}, **attrs)


@pytest.mark.parametrize("name, shape", [("gate_up", (4, 30, 2, 2304)), ("gate_up", (3, 32, 2, 2304)),
                                         ("down", (4, 16, 1, 3360)), ("down", (4, 32, 1, 2304)),
                                         ("logits", (2, 5))])
def test_a_moe_input_of_the_wrong_shape_fails_the_node(library, name, shape):
    """llgraph::MoE (plugins/cpu/moe.inc) on Q4_K gate/up and Q6_K down: each input whose shape disagrees with the
    others (experts, groups, super-blocks, bytes per group) fails the node with its message, never a read past it."""
    rng = np.random.default_rng(0)
    E, H, F = 4, 512, 256
    given = {"gate_up": rng.integers(0, 256, (E, 2 * F // 16, H // 256, 2304), dtype=np.uint8),
             "down": rng.integers(0, 256, (E, H // 16, F // 256, 3360), dtype=np.uint8)}
    for codes in given.values():  # d (and dmin) 0, the groups' first fields: the random blocks' weights stay finite
        codes[..., :64] = 0
    feed = {"x": rng.standard_normal((2, H)).astype(np.float32),
            "logits": rng.standard_normal((2, E)).astype(np.float32)}
    attrs = dict(k=2, normalize=1, format="Q4_K", down_format="Q6_K", rows=F)
    assert np.isfinite(_run(library, "MoE", given, feed, **attrs)).all()
    bad = rng.standard_normal(shape).astype(np.float32) if name == "logits" else np.zeros(shape, np.uint8)
    with pytest.raises(Exception, match="llgraph MoE: x must be"):
        _run(library, "MoE", {**given, **({} if name == "logits" else {name: bad})},
             {**feed, **({"logits": bad} if name == "logits" else {})}, **attrs)


def _compile(*flags, out: Path) -> subprocess.CompletedProcess:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    return subprocess.run([compiler, *cpu.FLAGS, *flags, f"-I{cpu._headers(progress=False)}", f"-I{cpu.SOURCE.parent}",
                           str(cpu.SOURCE), "-o", str(out)], capture_output=True, text=True)


def test_the_kernels_build_clean_with_wall_wextra(library, tmp_path):
    """Every warning -Wall -Wextra gives is in the compiler's own headers, none in llgraph's sources. (GCC 12 warns
    `'__Y' is used uninitialized` inside avx512fintrin.h's own _mm512_reduce_add_ps: its bug 105593, fixed in 13.)
    Read from the build's own log (the library the session built with cpu.FLAGS); a library built before logs were
    kept is compiled again here."""
    assert {"-Wall", "-Wextra"} <= set(cpu.FLAGS)
    log = library.with_name(cpu.BUILD_LOG)
    if log.exists():
        command, _, stderr = log.read_text().partition("\n")
        assert str(cpu.SOURCE) in command and "-Wall -Wextra" in command, command
    else:
        r = _compile(out=tmp_path / "lib.so")
        assert r.returncode == 0, r.stderr[-2000:]
        stderr = r.stderr
    warnings = re.findall(r"^(\S+?):\d+:\d+: warning: (.*)$", stderr, re.M)
    ours = [w for w in warnings if str(cpu.SOURCE.parent) in str(Path(w[0]).resolve()) or "plugins/cpu" in w[0]]
    theirs = {(Path(f).name, why) for f, why in warnings if (f, why) not in ours}
    print(f"{len(warnings)} warnings: {len(ours)} in llgraph's sources; the compiler's headers': {sorted(theirs)}")
    assert not ours, ours
    assert all(name.endswith("intrin.h") and "__Y" in why for name, why in theirs), theirs


SANITIZED_TESTS = ["tests/plugins/test_cpu_kernels.py::test_every_instruction_set_path_equals_float64",
                   "tests/plugins/test_cpu_superblocks.py", "tests/plugins/test_cpu_attention.py",
                   "tests/plugins/test_cpu_kv_formats.py", "tests/plugins/test_cpu_int8.py",
                   "tests/plugins/test_cpu_hardening.py::test_a_qlinear_input_of_the_wrong_size_fails_the_node",
                   "tests/plugins/test_cpu_hardening.py::test_a_qembedding_input_of_the_wrong_size_fails_the_node",
                   "tests/plugins/test_cpu_moe.py",
                   "tests/plugins/test_cpu_hardening.py::test_a_moe_input_of_the_wrong_shape_fails_the_node"]


@pytest.mark.sanitize  # .ci/run's own step: `pytest -m sanitize tests/plugins/test_cpu_hardening.py`
@pytest.mark.skipif(os.environ.get(cpu.SANITIZE_ENV) == "1", reason="this test is the sanitized run's launcher")
def test_the_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers(library, tmp_path):
    """The kernels' own tests, run in a process that loads the library built with -fsanitize=address,undefined
    (libasan preloaded: Python itself is not built with it): an out-of-bounds access or undefined arithmetic ends
    that process with the sanitizer's report."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or "g++"
    runtime = [subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
               for name in ("libasan.so", "libstdc++.so")]  # libstdc++ too: ASan intercepts its __cxa_throw
    if not all(Path(p).is_file() for p in runtime):
        pytest.skip(f"{compiler} has no libasan.so and libstdc++.so to preload")
    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "sanitizer"  # the reports (pytest's capture of fd 2 would lose them when the process aborts)
    env = {**os.environ, cpu.SANITIZE_ENV: "1", "LLGRAPH_CACHE_DIR": str(tmp_path / "cache"),
           "LD_PRELOAD": " ".join(runtime), "ORT_INCLUDE_DIR": str(cpu._headers(progress=False)),
           "ASAN_OPTIONS": f"detect_leaks=0:log_path={log}",
           "UBSAN_OPTIONS": f"print_stacktrace=1:halt_on_error=1:log_path={log}"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp",
                        str(tmp_path / "run"), *SANITIZED_TESTS], cwd=root, env=env, capture_output=True, text=True,
                       timeout=1800)
    print(r.stdout[-1500:])
    reports = "".join(p.read_text(errors="replace") for p in tmp_path.glob("sanitizer*"))
    assert r.returncode == 0 and not reports, (reports[:3000], r.stdout[-3000:], r.stderr[-3000:])
    built = [p for p in (tmp_path / "run").rglob(cpu.LIBRARY) if b"__asan_report_load" in p.read_bytes()]
    assert built, "the tests did not run on a library built with the sanitizers"


@pytest.mark.skipif(not (shutil.which("apt-get") and shutil.which("dpkg-deb")), reason="no apt-get here")
def test_a_failed_header_fetch_is_remembered_for_an_hour(tmp_path, monkeypatch):
    """Where Debian's archive cannot be reached, the first run says so; the next ones do not wait on apt-get again
    (before: each run spent ~7 s retrying before falling back to ONNX Runtime's own ops)."""
    monkeypatch.setattr(cpu, "HEADERS_SUITE", "deb http://127.0.0.1:9/debian trixie main")  # nothing listens
    config = tmp_path / "apt.conf"  # apt's own retries of a refused connection (1 + 2 + 4 s) are not what is held
    config.write_text('Acquire::Retries "0";\n')
    monkeypatch.setenv("APT_CONFIG", str(config))
    with pytest.raises(cpu.KernelsUnavailable, match=r"could not fetch libonnxruntime-dev from Debian \(.*127\.0\.0"
                                                     r"\.1:9.*(refused|connect)"):  # the cause, not "no such package"
        cpu.fetch_headers(False, tmp_path)
    monkeypatch.setattr(cpu.subprocess, "run", lambda *a, **k: pytest.fail(f"apt-get ran again: {a}"))
    with pytest.raises(cpu.KernelsUnavailable, match="tried just now; retried after an hour"):
        cpu.fetch_headers(False, tmp_path)
    earlier = (tmp_path / cpu.FAILED).stat().st_mtime - 2 * cpu.RETRY_AFTER
    os.utime(tmp_path / cpu.FAILED, (earlier, earlier))
    with pytest.raises(pytest.fail.Exception, match="apt-get ran again"):  # an hour later: tried again
        cpu.fetch_headers(False, tmp_path)
