"""Load the official Cogformer / Transformer 141M checkpoints (github.com/trestad/CogAttn) into `CogformerForCausalLM`.

The official files (`cog_ckpt_100.00_Bi.pt`, `vanilla_ckpt_100.00_Bi.pt`) are `torch.save` dicts with
  * "model_cfg": kwargs of their `Transformer` class: vocab_size, n_layers, max_seq_length, dim, n_heads,
    head_dim, hidden_dim, norm_eps, attn_type ("vanilla" = softmax everywhere, "np" = Cog in all layers but the
    first and the last), shared_expert_recipe;
  * "model": the state dict, every projection an `nn.Parameter` of shape (in, out) used as `x @ w`:
      embedding.weight                                  (V, D)
      layers.{i}.attention.{qw,kw,vw}                   (D, nh*hd)
      layers.{i}.attention.ow                           (nh*hd, D)
      layers.{i}.ffn.shared_experts.0.{gw,pw}           (D, F)     FFN: (x @ gw) * silu(x @ pw) @ ow
      layers.{i}.ffn.shared_experts.0.ow                (F, D)
      layers.{i}.attention_norm.weight, layers.{i}.ffn_norm.weight, norm.weight    (D,)
      output.weight                                     (V, D)    an nn.Linear, untied
      freqs_cis                                         (2 * max_seq_length, hd/2) complex64 RoPE table, theta 10000
      shortcut_bar                                      (4095,) buffer, unused
The format was read from the official `Cogformer/model.py` and `Cogformer/attention.py`; no official checkpoint
was available to check against, so the tests build a synthetic one in this format.

Mapping and the assumptions it rests on:
  * Weights are transposed into `nn.Linear` layout (out, in).
  * SwiGLU: the official FFN applies silu to `x @ pw` and multiplies by `x @ gw`, so `pw` -> `gate_proj` (silu
    branch) and `gw` -> `up_proj`.
  * RoPE: the official code rotates interleaved pairs (dims 2i, 2i+1) as complex numbers (`torch.view_as_complex`)
    with theta 10000; this model rotates the pairs (i, i + hd/2). The columns of `qw` and `kw` are permuted within
    each head (even dims first, then odd dims), which makes the two identical: q.k is unchanged because both sides
    get the same permutation, and values/outputs are untouched.
  * The checkpoint's `freqs_cis` (when present) must equal the RoPE table this model uses (same theta, head dim
    and length 2 * max_seq_length): a table built with another theta, or of another shape, is refused rather
    than silently replaced by ours (`check_rope_table`).
  * Attention scale hd**-0.5, RMSNorm in float32 with `norm_eps`, positions from 0: as the official model.
  * Only `shared_experts.0` is used by the official forward, so only it is loaded; its width gives
    intermediate_size.
  * The official evaluation masks attention within BOS-delimited documents (`generate_attn_masks`); a single
    document per sequence, as in lm-eval and the probes, needs no such mask.
  * Keys prefixed by "module." (DDP) or "_orig_mod." (torch.compile) are accepted.
  * The Llama-2 tokenizer the models were trained with is not part of the checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

from uvic.io import UnsafeFileError, load_torch_data
from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM, RotaryEmbedding


logger = logging.getLogger(__name__)

_ATTN_TYPES = {"vanilla": ("softmax", 0), "np": ("cog", 1)}
_IGNORED = ("freqs_cis", "shortcut_bar")
_ROPE_KEY = "freqs_cis"


def interleaved_to_half_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """Index (nh*hd,) that reorders each head's dims from interleaved pairs (2i, 2i+1) to halves (i, i + hd/2)."""
    per_head = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return torch.cat([h * head_dim + per_head for h in range(n_heads)])


def _strip_prefixes(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            if key.startswith(prefix):
                key = key[len(prefix) :]
        out[key] = value
    return out


def config_from_official(model_cfg: dict, state: dict[str, torch.Tensor]) -> CogformerConfig:
    """A CogformerConfig equivalent to an official `model_cfg` (the FFN width is read from the weights)."""
    required = ("vocab_size", "n_layers", "dim", "n_heads", "head_dim", "attn_type")
    missing = [k for k in required if k not in model_cfg]
    if missing:
        raise ValueError(f"official model_cfg lacks {missing}; got keys {sorted(model_cfg)}")
    if model_cfg["attn_type"] not in _ATTN_TYPES:
        raise ValueError(f"unknown official attn_type {model_cfg['attn_type']!r}; expected one of {sorted(_ATTN_TYPES)}")
    attention, k = _ATTN_TYPES[model_cfg["attn_type"]]
    gw = state.get("layers.0.ffn.shared_experts.0.gw")
    if gw is None:
        raise ValueError("official state dict lacks layers.0.ffn.shared_experts.0.gw")
    return CogformerConfig(
        vocab_size=model_cfg["vocab_size"],
        hidden_size=model_cfg["dim"],
        intermediate_size=gw.shape[1],
        num_hidden_layers=model_cfg["n_layers"],
        num_attention_heads=model_cfg["n_heads"],
        head_dim=model_cfg["head_dim"],
        max_position_embeddings=model_cfg.get("max_seq_length", 2048),
        rms_norm_eps=model_cfg.get("norm_eps", 1e-6),
        rope_theta=10000.0,  # official precompute_freqs_cis default
        attention=attention,
        keep_softmax_first=k,
        keep_softmax_last=k,
    )


def _theta_of_table(table: torch.Tensor) -> float | None:
    """The RoPE base a (L, hd/2) complex table was built with, read off position 1 (angle_i = theta^(-2i/hd))."""
    if table.shape[0] < 2 or table.shape[1] < 2:
        return None
    half = table.shape[1]
    slowest = torch.angle(table[1, -1].to(torch.complex128)).item()  # theta^(-(hd-2)/hd), in (0, 1]
    if slowest <= 0:
        return None
    return math.exp(-math.log(slowest) * half / (half - 1))


def check_rope_table(table: torch.Tensor, config: CogformerConfig, key: str = _ROPE_KEY) -> None:
    """Refuse an official RoPE table that differs from the one `config` builds.

    Args:
        table: (2 * max_seq_length, head_dim / 2) complex, the official `precompute_freqs_cis(head_dim,
            2 * max_seq_length, theta)`: entry (m, i) = exp(1j * m * theta^(-2i/head_dim)).
        config: the converted config; its `RotaryEmbedding(head_dim, rope_theta)` gives the expected angles.
        key: the checkpoint key, for the error message.
    Raises:
        ValueError naming `key`, the expected and found shape, and the expected and found theta.
    """
    hd, theta = config.head_dim, config.rope_theta
    expected_shape = (2 * config.max_position_embeddings, hd // 2)
    if not torch.is_complex(table):
        raise ValueError(f"official checkpoint key {key!r} should be a complex RoPE table, got dtype {table.dtype}")
    if tuple(table.shape) != expected_shape:
        raise ValueError(
            f"official checkpoint key {key!r} has shape {tuple(table.shape)}, but head_dim={hd} and "
            f"max_seq_length={config.max_position_embeddings} give a RoPE table of shape {expected_shape}"
        )
    # The model's own table: cos/sin of its rotate-half layout, whose first hd/2 columns are the official pairs.
    positions = torch.arange(expected_shape[0])[None]
    cos, sin = RotaryEmbedding(hd, theta)(positions, torch.float32)
    ours = torch.complex(cos[0, 0, :, : hd // 2], sin[0, 0, :, : hd // 2])
    # Both are float32 angles m * freq; their rounding grows with the position m.
    tol = 1e-5 + 8 * torch.finfo(torch.float32).eps * expected_shape[0]
    err = (table.to(torch.complex64) - ours).abs().max().item()
    if not err <= tol:
        found = _theta_of_table(table)
        found_text = f"{found:.6g}" if found is not None else "unknown"
        raise ValueError(
            f"official checkpoint key {key!r} is a RoPE table with theta {found_text}, but this model uses theta "
            f"{theta:g} (head_dim={hd}, shape {expected_shape}); max |difference| {err:.3g}"
        )


def convert_official_state_dict(model_cfg: dict, state: dict[str, torch.Tensor]) -> tuple[CogformerConfig, dict]:
    """(config, state dict for `CogformerForCausalLM`) from an official `model_cfg` and `model` state dict."""
    state = _strip_prefixes(state)
    config = config_from_official(model_cfg, state)
    if _ROPE_KEY in state:
        check_rope_table(state[_ROPE_KEY], config)
    nh, hd = config.num_attention_heads, config.head_dim
    perm = interleaved_to_half_permutation(nh, hd)
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"official state dict lacks {key!r}")
        used.add(key)
        return state[key]

    out = {"model.embed_tokens.weight": take("embedding.weight"), "model.norm.weight": take("norm.weight")}
    out["lm_head.weight"] = take("output.weight")
    for i in range(config.num_hidden_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "self_attn.q_proj.weight"] = take(src + "attention.qw")[:, perm].t()
        out[dst + "self_attn.k_proj.weight"] = take(src + "attention.kw")[:, perm].t()
        out[dst + "self_attn.v_proj.weight"] = take(src + "attention.vw").t()
        out[dst + "self_attn.o_proj.weight"] = take(src + "attention.ow").t()
        out[dst + "mlp.gate_proj.weight"] = take(src + "ffn.shared_experts.0.pw").t()  # the silu branch
        out[dst + "mlp.up_proj.weight"] = take(src + "ffn.shared_experts.0.gw").t()
        out[dst + "mlp.down_proj.weight"] = take(src + "ffn.shared_experts.0.ow").t()
        out[dst + "input_layernorm.weight"] = take(src + "attention_norm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "ffn_norm.weight")
    left = [k for k in state if k not in used and not k.endswith(_IGNORED) and ".shared_experts." not in k]
    if left:
        raise ValueError(f"official state dict has keys this loader does not know: {left[:8]}")
    return config, {k: v.contiguous() for k, v in out.items()}


def cogformer_from_official(
    path: str | os.PathLike, attention_backend: str = "auto", trust_pickle: bool = False
) -> CogformerForCausalLM:
    """Load an official Cogformer / Transformer `.pt` checkpoint as a `CogformerForCausalLM` in eval mode.

    The file is read with `torch.load(weights_only=True)` (tensors and plain data; nothing in it runs).
    `trust_pickle=True` unpickles it in full, which runs whatever code the file holds: only for a file you trust
    that stores other Python objects (e.g. an argparse Namespace).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"official checkpoint {path} not found; download it from the links in github.com/trestad/CogAttn "
            "(readme 'Checkpoints') and pass its path"
        )
    if trust_pickle:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    else:
        try:
            ckpt = load_torch_data(path, what="official checkpoint")
        except UnsafeFileError as err:
            raise UnsafeFileError(f"{err}; if you trust the file, load it with "
                                  f"cogformer_from_official(path, trust_pickle=True)") from err
    if not isinstance(ckpt, dict) or "model_cfg" not in ckpt or "model" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path} is not an official Cogformer checkpoint: expected 'model_cfg' and 'model', got {keys}")
    config, state = convert_official_state_dict(dict(ckpt["model_cfg"]), ckpt["model"])
    config.attention_backend = attention_backend
    model = CogformerForCausalLM(config)
    model.load_state_dict(state, strict=True)
    logger.info("loaded official %s checkpoint %s (%s layers)", config.attention, path, config.attention_types())
    return model.eval()
