"""RoPE inverse frequencies for each variant of a config's `rope` (default, linear, static/dynamic NTK, YaRN,
Llama 3.1), written from the papers' formulas; the builder turns them into the RotaryCosSin constant."""

from __future__ import annotations

import math

from llgraph.config import LlamaConfig, RopeConfig


def rope_inv_freq(cfg: LlamaConfig, seq_len: int | None = None, rope: RopeConfig | None = None):
    """(inv_freq[rotary_dim/2] float64 numpy, attention_scaling) for the config's RoPE variant (`rope`: another of
    its RoPEs, e.g. cfg.rope_local).

    Written from the papers' formulas (position interpolation, NTK-aware, dynamic NTK, YaRN, Llama 3.1); the tests
    check each against transformers' `modeling_rope_utils`. `seq_len` only matters for 'dynamic'.
    """
    import numpy as np

    r = rope or cfg.rope
    d = r.rotary_dim
    exponent = np.arange(0, d, 2, dtype=np.float64) / d
    base, scaling = r.theta, 1.0
    if r.type == "ntk":  # NTK-aware static: stretch the base so the lowest frequency is interpolated by `factor`
        base = r.theta * r.factor ** (d / (d - 2))
    if r.type == "dynamic":  # dynamic NTK: the same stretch, by how far seq_len runs past the original length
        orig = r.original_max_position_embeddings or cfg.max_position_embeddings
        length = max(seq_len or orig, orig)
        base = r.theta * ((r.factor * length / orig) - (r.factor - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / base ** exponent
    if r.type == "linear":  # position interpolation: positions / factor
        inv_freq = inv_freq / r.factor
    elif r.type == "llama3":
        orig = r.original_max_position_embeddings or cfg.max_position_embeddings  # validated: set for llama3
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smooth = np.clip(smooth, 0.0, 1.0)  # 0 for long wavelengths (scaled by 1/factor), 1 for short (kept)
        inv_freq = (1 - smooth) * inv_freq / r.factor + smooth * inv_freq
    elif r.type == "yarn":
        inv_freq, scaling = _yarn(r, d, inv_freq)
    return inv_freq, scaling


def _yarn(r: RopeConfig, d: int, inv_freq):
    import numpy as np

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if r.attention_factor is not None:
        scaling = r.attention_factor
    elif r.mscale and r.mscale_all_dim:
        scaling = mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
    else:
        scaling = mscale(r.factor)
    orig = r.original_max_position_embeddings

    def correction_dim(rotations):  # the dimension whose wavelength makes `rotations` turns over `orig` tokens
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency (high freq), 0: interpolate by 1/factor
    return inv_freq / r.factor * (1 - extrapolate) + inv_freq * extrapolate, scaling
