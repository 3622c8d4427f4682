"""LoRA adapters merged at export (llgraph/lora.py), held to PEFT's own `merge_and_unload` on a tiny Llama made by
transformers: the merged model's logits, through the export on ONNX Runtime and through the torch executor; the
scale (DIR:0.5 equals PEFT with half the alpha); rsLoRA; two adapters at once; an RTN export of the merge equal to
the RTN export of PEFT's merged checkpoint; the cache keyed on the adapter; one-line refusals."""

import json

import numpy as np
import pytest
import torch
from conftest import need

peft = need("peft")
transformers = need("transformers")

from test_families import DIMS  # noqa: E402

from llgraph.errors import LlgraphError  # noqa: E402
from llgraph.lora import Adapter  # noqa: E402
from llgraph.weight_request import Weights  # noqa: E402

TOL = 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = np.array([[5, 17, 42, 8, 77, 3, 60, 21]], np.int64)


def _adapter(base, folder, seed: int, **config):
    """A PEFT adapter with random (non-zero) A and B, saved by PEFT's save_pretrained."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return folder


def _peft_logits(base_folder, adapters) -> np.ndarray:
    """PEFT's merge_and_unload of `adapters` (folders, in order) on the base, then the merged model's logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_folder, attn_implementation="eager").float()
    for k, folder in enumerate(adapters):
        model = peft.PeftModel.from_pretrained(model, folder, adapter_name=f"a{k}").merge_and_unload()
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.numpy(), model


def _ours(folder, weights, backend="ort") -> np.ndarray:
    from llgraph.runtime import open_runner

    runner = open_runner(str(folder), backend, weights=weights, max_seq_len=16)
    runner.backend.allocate(1)
    return np.asarray(runner.backend.forward(IDS, np.arange(IDS.shape[1])[None]), np.float32)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """transformers' LlamaForCausalLM, tiny, weights drawn with std 0.3 (decisive logits), saved by save_pretrained."""
    folder = tmp_path_factory.mktemp("lora-base")
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DIMS)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


def _fresh(base_folder):
    return transformers.AutoModelForCausalLM.from_pretrained(base_folder, attn_implementation="eager").float()


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_merged_logits_equal_peft_merge_and_unload(base, tmp_path, backend, report):
    adapter = _adapter(_fresh(base), tmp_path / "a", 1, r=4, lora_alpha=8)
    want, _ = _peft_logits(base, [adapter])
    ours = _ours(base, Weights(lora=(Adapter.parse(str(adapter)),)), backend)
    plain = _ours(base, Weights(), backend)
    report(f"LoRA r=4 merged ({backend}) vs PEFT merge_and_unload", float(np.abs(ours - want).max()), TOL)
    assert np.abs(ours - want).max() <= TOL
    assert np.abs(plain - want).max() > 100 * TOL  # the adapter changes the logits: the test can tell


def test_scale_rslora_and_two_adapters(base, tmp_path, report):
    one = _adapter(_fresh(base), tmp_path / "one", 2, r=4, lora_alpha=8)
    half = tmp_path / "half"  # the same tensors with half the alpha: PEFT's own view of scale 0.5
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes((one / "adapter_model.safetensors").read_bytes())
    config = json.loads((one / "adapter_config.json").read_text())
    (half / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 4}))
    want, _ = _peft_logits(base, [half])
    ours = _ours(base, Weights(lora=(Adapter.parse(f"{one}:0.5"),)))
    report("LoRA at scale 0.5 vs PEFT with alpha / 2", float(np.abs(ours - want).max()), TOL)
    assert np.abs(ours - want).max() <= TOL

    rs = _adapter(_fresh(base), tmp_path / "rs", 3, r=8, lora_alpha=4, use_rslora=True)
    want, _ = _peft_logits(base, [one, rs])
    ours = _ours(base, Weights(lora=(Adapter.parse(str(one)), Adapter.parse(str(rs)))))
    report("two adapters (one rsLoRA) vs PEFT, merged in turn", float(np.abs(ours - want).max()), TOL)
    assert np.abs(ours - want).max() <= TOL


def test_an_rtn_export_rounds_the_merged_weights(base, tmp_path):
    adapter = _adapter(_fresh(base), tmp_path / "a", 4, r=4, lora_alpha=8)
    _, merged = _peft_logits(base, [adapter])
    merged.save_pretrained(tmp_path / "merged")
    int8 = Weights(quantize="int8")
    ours = _ours(base, int8.replace(lora=(Adapter.parse(str(adapter)),)))
    theirs = _ours(tmp_path / "merged", int8)
    print(f"int8 RTN of our merge vs of PEFT's merged checkpoint: max |diff| {np.abs(ours - theirs).max():.2e}")
    assert np.abs(ours - theirs).max() <= TOL


def test_refusals_are_one_line(base, tmp_path):
    from llgraph.bundled import bundled_model
    from llgraph.export import export_model

    adapter = _adapter(_fresh(base), tmp_path / "a", 5, r=4, lora_alpha=8)
    with pytest.raises(LlgraphError, match="no adapter_config.json"):
        Adapter.parse(str(tmp_path))
    with pytest.raises(LlgraphError, match="must be a finite number"):
        Adapter.parse(f"{adapter}:much")
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LlgraphError, match="DoRA"):
        export_model(base, checkpoint=base, out=tmp_path / "x", weights=Weights(lora=(Adapter.parse(str(dora)),)))
    smollm2, lora = bundled_model("smollm2"), Weights(lora=(Adapter.parse(str(adapter)),))
    with pytest.raises(LlgraphError, match="GGUF"):  # SmolLM2's Q4_1 blocks
        export_model(smollm2, checkpoint=smollm2, out=tmp_path / "y", weights=lora)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # the export cache keys on the adapter: another scale is another entry
    keyed = Weights(kernels="standard")
    assert len({keyed.mode, keyed.replace(lora=(Adapter.parse(str(adapter)),)).mode,
                keyed.replace(lora=(Adapter.parse(f"{adapter}:2"),)).mode,
                keyed.replace(dequantize=True, lora=(Adapter.parse(str(adapter)),)).mode,
                keyed.replace(dequantize=True).mode}) == 5


def _tamper(adapter, folder, case: str):
    """A copy of `adapter` damaged as `case` says (issue 52: each wrote an export and answered nothing, or ended in a
    traceback)."""
    from safetensors.numpy import load_file, save_file

    folder.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    a_key = next(k for k in tensors if ".lora_A." in k)
    b_key = a_key.replace(".lora_A.", ".lora_B.")
    if case == "alpha NaN":
        config["lora_alpha"] = float("nan")
    elif case == "r true":
        config["r"] = True
    elif case in ("A nan", "B inf"):
        key = a_key if case == "A nan" else b_key
        tensors[key] = tensors[key].copy()
        tensors[key].flat[3] = np.nan if case == "A nan" else np.inf
    elif case == "B of another rank":  # A [4, in], B [out, 8]
        tensors[b_key] = np.concatenate([tensors[b_key], tensors[b_key]], axis=1)
    elif case == "A and B 1e20":  # finite, each; their product is not
        tensors[a_key], tensors[b_key] = tensors[a_key] * 1e20, tensors[b_key] * 1e20
    elif case == "alpha 1e308":
        config["lora_alpha"] = 1e308
    elif case == "A 1-D":
        tensors[a_key] = tensors[a_key].reshape(-1).copy()
    elif case == "B 3-D":
        tensors[b_key] = tensors[b_key][None].copy()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _generate_with(base, tmp_path, case: str, scale: str):
    """`llgraph generate` with the adapter `case` (_tamper's) at `scale` -> (the run, its error lines, its cache)."""
    import subprocess
    import sys

    good = _adapter(_fresh(base), tmp_path / "good", 3, r=4, lora_alpha=8)
    adapter = good if case == "good" else _tamper(good, tmp_path / "bad", case)
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-m", "llgraph", "generate", str(base), "--lora", f"{adapter}{scale}",
                        "--tokens", "1,2", "--max-new-tokens", "2", "--cache-dir", str(cache)],
                       capture_output=True, text=True)
    return r, [line for line in r.stderr.splitlines() if line.startswith("llgraph: error:")], cache


@pytest.mark.parametrize("case, scale, words", [
    ("good", ":nan", ["finite number"]), ("good", ":inf", ["finite number"]), ("good", ":-1e309", ["finite number"]),
    ("alpha NaN", "", ["positive finite 'lora_alpha'"]), ("r true", "", ["positive integer 'r'", "True"]),
    ("A nan", "", ["lora_A", "NaN or infinite"]), ("B inf", "", ["lora_B", "NaN or infinite"]),
    ("B of another rank", "", ["lora_A", "is [4, ", ", 8]; LoRA wants A [r, in] and B [out, r]"]),
    ("A 1-D", "", ["lora_A", "wants A [r, in]"]), ("B 3-D", "", ["lora_B", "wants A [r, in]"]),
])
def test_an_adapter_that_cannot_merge_is_one_line_before_anything_is_written(base, tmp_path, case, scale, words):
    r, errors, cache = _generate_with(base, tmp_path, case, scale)
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in errors[0] for w in words), errors[0]
    assert "exporting" not in r.stderr  # refused before the export is announced
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))  # and nothing written


@pytest.mark.parametrize("case, scale", [("A and B 1e20", ""), ("alpha 1e308", ""), ("good", ":1e300")])
def test_an_adapter_whose_merge_overflows_is_one_line_and_leaves_nothing(base, tmp_path, case, scale):
    """Finite values that overflow once multiplied (issue 64: they exported non-finite weights and answered 0,0,0,0
    with exit 0): one line naming the weight, exit 2, no export left behind."""
    r, errors, cache = _generate_with(base, tmp_path, case, scale)
    print(errors)
    assert r.returncode == 2 and len(errors) == 1 and "overflows" in errors[0] and "Traceback" not in r.stderr, \
        r.stderr
    left = [p.name for p in cache.rglob("*") if p.is_file()] if cache.exists() else []
    assert left in ([], ["hashes.json"]), left  # the checkpoint's hash record at most: no export, not even in part


def test_cache_list_names_each_entry_s_adapter_and_scale(base, tmp_path):
    import subprocess
    import sys

    adapter = _adapter(_fresh(base), tmp_path / "a", 9, r=4, lora_alpha=8)
    cache = tmp_path / "cache"
    for scale in ("", ":0.5"):
        r = subprocess.run([sys.executable, "-m", "llgraph", "generate", str(base), "--lora", f"{adapter}{scale}",
                            "--tokens", "1,2", "--max-new-tokens", "1", "--cache-dir", str(cache)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    listed = subprocess.run([sys.executable, "-m", "llgraph", "cache", "list", "--cache-dir", str(cache)],
                            capture_output=True, text=True).stdout
    print(listed)
    assert "+ LoRA a\n" in listed and "+ LoRA a:0.5\n" in listed
