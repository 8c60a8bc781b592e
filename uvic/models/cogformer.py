"""Cogformer: a Llama-style decoder-only language model with Cog attention (paper Sec. 4.1 and App. C).

Lv et al., "More Expressive Attention with Negative Weights", ICML 2025. The architecture follows Llama: token
embedding, pre-norm decoder layers (RMSNorm before attention and before the FFN), rotary position embeddings,
a SwiGLU feed-forward network, no biases, a final RMSNorm and an untied output head. Every layer uses Cog attention
(`uvic.attention.cog_attention`, signed weights `sign(p) * softmax(|p|)`) except the first `keep_softmax_first` and
the last `keep_softmax_last` layers, which keep softmax (k and k with k = 1 at 141M, 2 at 600M, 3 at 1B; paper
Sec. 4.1 / App. C), as `UViTModel`'s (`uvic.attention.attention_placement`). The old single count
`num_softmax_layers` (both ends) and configs saved with it still load, with a FutureWarning.
`attention="softmax"` gives the Transformer baseline with the same parameters.

The model is a transformers `PreTrainedModel`: `forward(input_ids, attention_mask, past_key_values, labels)`
returns loss and logits, the KV cache is a transformers `Cache` (DynamicCache), `generate()` works, and importing
this module registers the `"cogformer"` model type with `AutoConfig` / `AutoModelForCausalLM`.

Shape letters: B batch, L new tokens, Lk tokens seen by attention (cache + new), D hidden size, nh heads,
hd head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from uvic.attention import BACKENDS, attention_op, attention_placement, check_attention_kind, renamed_placement
from uvic.presets import COGFORMER_PRESETS, cogformer_preset  # noqa: F401  (re-exported)


def _renamed_placement(init):
    """`CogformerConfig.__init__` that also takes the old placement: `num_softmax_layers` = k for both ends, an end
    given apart (not None) winning, as Python callers and the config.json files saved before the rename write it
    (those hold `keep_softmax_first` / `keep_softmax_last` as null, or not at all); one FutureWarning."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if "num_softmax_layers" in kwargs:
            first, last = renamed_placement(kwargs.pop("num_softmax_layers"), kwargs.pop("keep_softmax_first", None),
                                            kwargs.pop("keep_softmax_last", None), old="num_softmax_layers",
                                            where=type(self).__name__)
            kwargs.update(keep_softmax_first=first, keep_softmax_last=last)
        return init(self, *args, **kwargs)

    return wrapper


class CogformerConfig(PretrainedConfig):
    """Hyperparameters of a Cogformer (defaults: the paper's 141M model, Sec. 4.1).

    Args:
        vocab_size: V, the Llama tokenizer's 32000 in the paper.
        hidden_size: D.
        intermediate_size: hidden width of the SwiGLU FFN.
        num_hidden_layers: decoder layers.
        num_attention_heads: nh.
        head_dim: hd; defaults to hidden_size // num_attention_heads.
        max_position_embeddings: training context length (RoPE itself has no hard limit).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        attention: "cog" (Cogformer) or "softmax" (the Transformer baseline).
        keep_softmax_first: with attention="cog", how many layers at the start keep softmax attention, as
            `UViTModel`'s (the paper's k: 1 at 141M, 2 at 600M, 3 at 1B).
        keep_softmax_last: the same at the end. The counts of the two ends may not overlap.
        attention_backend: backend passed to `uvic.attention` ("auto", "reference", "torch", "triton").
        initializer_range: std of the normal init of linear and embedding weights.
    """

    model_type = "cogformer"
    keys_to_ignore_at_inference = ["past_key_values"]

    @_renamed_placement
    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 768,
        intermediate_size: int = 3072,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        head_dim: int | None = None,
        max_position_embeddings: int = 2048,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        attention: str = "cog",
        keep_softmax_first: int = 1,
        keep_softmax_last: int = 1,
        attention_backend: str = "auto",
        initializer_range: float = 0.02,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        check_attention_kind(attention)
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.attention = attention
        self.keep_softmax_first = keep_softmax_first
        self.keep_softmax_last = keep_softmax_last
        self.attention_types()  # checks the counts now (ValueError), not at the first model built from the config
        self.attention_backend = attention_backend
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def attention_types(self) -> list[str]:
        """Per-layer attention ("cog" or "softmax"), `uvic.attention.attention_placement` of the layers: softmax
        in the first `keep_softmax_first` and the last `keep_softmax_last` layers, Cog between; all softmax with
        attention="softmax"."""
        return attention_placement(self.num_hidden_layers, self.keep_softmax_first, self.keep_softmax_last,
                                   self.attention)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with the reduction in at least float32, as Llama."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., D) -> (..., D) in x's dtype."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021) in the "rotate half" layout: dims i and i + hd/2 form a pair."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # No buffer: the hd/2 frequencies are recomputed per call, so nothing depends on how transformers
        # materialises non-persistent buffers when loading (meta-device init).
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B, L) -> cos, sin: (B, 1, L, hd), computed in float32 and cast to `dtype`."""
        i = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / (self.theta ** (i / self.head_dim))  # (hd/2,)
        freqs = position_ids[..., None].float() * inv_freq  # (B, L, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, L, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, L, hd); cos, sin: (B, 1, L, hd). Rotates each pair (x_i, x_{i+hd/2}) by its angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CogformerAttention(nn.Module):
    """Causal multi-head attention through `uvic.attention` (Cog or softmax), with an optional KV cache."""

    def __init__(self, config: CogformerConfig, layer_idx: int, attention: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention = attention
        self.nh, self.hd = config.num_attention_heads, config.head_dim
        self.backend = config.attention_backend
        inner = self.nh * self.hd
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        key_padding_mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        """
        Args:
            x: (B, L, D) normalised hidden states of the new tokens.
            rope: cos, sin of shape (B, 1, L, hd) for the new tokens' positions.
            key_padding_mask: (B, Lk) bool, True = real token; None when every key is real.
            cache: transformers Cache holding this layer's past keys/values (updated in place), or None.
        Returns:
            (B, L, D).
        """
        q, k, v = (rearrange(proj(x), "B L (nh hd) -> B nh L hd", nh=self.nh)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, nh, Lk, hd)
        attn = attention_op(self.attention)  # cog_attention or softmax_attention
        # Bottom-right aligned causal mask: new token i sees every cached key and the new keys up to itself.
        o = attn(q, k, v, causal=True, key_padding_mask=key_padding_mask, backend=self.backend)
        return self.o_proj(rearrange(o, "B nh L hd -> B L (nh hd)"))

    def extra_repr(self) -> str:
        return f"attention={self.attention!r}, heads={self.nh}, head_dim={self.hd}"


class CogformerMLP(nn.Module):
    """SwiGLU FFN (Shazeer 2020): down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, D) -> (B, L, D)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CogformerDecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then h + ffn(norm(h)) (Llama; paper Sec. 4.1)."""

    def __init__(self, config: CogformerConfig, layer_idx: int, attention: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CogformerAttention(config, layer_idx, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = CogformerMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, rope, key_padding_mask, cache) -> torch.Tensor:
        """x: (B, L, D) -> (B, L, D); see `CogformerAttention.forward` for the other arguments."""
        h = x + self.self_attn(self.input_layernorm(x), rope, key_padding_mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# The name transformers' output classes give the KV cache: `cache` from 5.24 on, where building or reading an output
# under the old name `past_key_values` logs a deprecation warning; `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def _one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The KV cache under either name: `past_key_values` (transformers < 5.24) or `cache` (its new name, which
    `generate()` passes from 5.24 on)."""
    if past_key_values is not None and cache is not None:
        raise ValueError("pass the KV cache as past_key_values or as cache, not both")
    return cache if past_key_values is None else past_key_values


class CogformerPreTrainedModel(PreTrainedModel):
    """Weight init (normal(0, initializer_range), norms at 1) and the transformers plumbing."""

    config_class = CogformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CogformerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]


class CogformerModel(CogformerPreTrainedModel):
    """Embedding, decoder layers and the final RMSNorm; returns the normalised last hidden states."""

    def __init__(self, config: CogformerConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [CogformerDecoderLayer(config, i, attention) for i, attention in enumerate(config.attention_types())]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.gradient_checkpointing = False  # set by `gradient_checkpointing_enable()`
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids: (B, L) token ids (or `inputs_embeds` (B, L, D)).
            attention_mask: (B, Lk) 1 = real token, 0 = padding, over cached + new tokens (HF convention).
            position_ids: (B, L) RoPE positions; by default counted over the real tokens only
                (`attention_mask.cumsum(-1) - 1`), so a left-padded prompt gets the same positions as unpadded.
            past_key_values: a transformers Cache (e.g. DynamicCache) with the earlier tokens, or None.
            cache: the same argument under the name transformers >= 5.24 uses (its `generate()` passes `cache=`);
                give one of the two.
            use_cache: create/extend a DynamicCache and return it (defaults to config.use_cache at inference).
            output_hidden_states: also return the input of every layer and the final output.
            kwargs: other arguments `generate()` may pass; unused.
        Returns:
            BaseModelOutputWithPast with `last_hidden_state` (B, L, D) after the final norm.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        past_key_values = _one_cache(past_key_values, cache)
        if past_key_values is not None and not isinstance(past_key_values, Cache):
            raise ValueError(
                f"past_key_values must be a transformers Cache (e.g. DynamicCache), got {type(past_key_values).__name__}"
            )
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, L, D)
        B, L, _ = x.shape
        use_cache = (self.config.use_cache and not self.training) if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        past = past_key_values.get_seq_length() if past_key_values is not None else 0

        key_padding_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape != (B, past + L):
                raise ValueError(
                    f"attention_mask must have shape (B, cached + new tokens) = {(B, past + L)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            key_padding_mask = attention_mask.to(x.device).bool()
            if position_ids is None:
                position_ids = (key_padding_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -L:]
            if bool(key_padding_mask.all()):
                key_padding_mask = None  # no padding: let the op take its unmasked fast path
        if position_ids is None:
            position_ids = torch.arange(past, past + L, device=x.device)[None].expand(B, L)
        rope = self.rotary_emb(position_ids.to(x.device), x.dtype)

        hidden_states = [] if output_hidden_states else None
        for layer in self.layers:
            if hidden_states is not None:
                hidden_states.append(x)
            if self.gradient_checkpointing and self.training:
                x = self._gradient_checkpointing_func(layer.__call__, x, rope, key_padding_mask, past_key_values)
            else:
                x = layer(x, rope, key_padding_mask, past_key_values)
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        return BaseModelOutputWithPast(
            last_hidden_state=x,
            **{_CACHE_FIELD: past_key_values if use_cache else None},
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
        )


class CogformerForCausalLM(CogformerPreTrainedModel, GenerationMixin):
    """Cogformer with its untied output head; a transformers causal LM (`generate()`, `AutoModelForCausalLM`)."""

    def __init__(self, config: CogformerConfig) -> None:
        super().__init__(config)
        self.model = CogformerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' `from_pretrained`; a local directory is checked first
        (`uvic.models.config_check.check_cogformer_dir`): its config.json must be an object of settings of the
        right types and ranges that describes a model of the shapes its weights hold, else one ValueError, before
        anything is allocated."""
        folder = Path(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if folder.is_dir():
            from uvic.models.config_check import check_cogformer_dir

            check_cogformer_dir(folder, f"CogformerForCausalLM {folder}", CogformerConfig, cls)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    # get/set_input_embeddings: transformers' defaults find `model.embed_tokens` (base_model_prefix = "model").

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """
        Args:
            input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache,
                output_hidden_states, cache: as `CogformerModel.forward`.
            labels: (B, L) targets aligned with input_ids (shifted inside: position t predicts labels[t + 1]);
                -100 entries are ignored.
            return_dict: return a tuple (loss?, logits, past_key_values?) when False.
            logits_to_keep: compute logits for the last `logits_to_keep` positions only (0 = all).
        Returns:
            CausalLMOutputWithPast with `logits` (B, L, V) in float32, `loss` (mean next-token cross-entropy)
            when labels are given, and `past_key_values`.
        """
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions is not supported: the fused attention op does not form the weights")
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=_one_cache(past_key_values, cache),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h).float()  # (B, L, V)
        loss = None
        if labels is not None:
            if logits_to_keep:
                raise ValueError("labels cannot be combined with logits_to_keep")
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        cache = getattr(out, _CACHE_FIELD)
        if return_dict is False:
            return tuple(t for t in (loss, logits, cache) if t is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache}, hidden_states=out.hidden_states)


def cogformer_config(preset: str, **overrides) -> CogformerConfig:
    """A CogformerConfig from a preset name ("tiny", "141M", "600M", "1B") plus keyword overrides (the old
    `num_softmax_layers` replaces the preset's two ends)."""
    kwargs = cogformer_preset(preset)
    if "num_softmax_layers" in overrides:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("keep_softmax_first", "keep_softmax_last")}
    return CogformerConfig(**{**kwargs, **overrides})


def register_auto_classes() -> None:
    """Register "cogformer" with AutoConfig and AutoModelForCausalLM (idempotent; called when this module loads)."""
    try:
        AutoConfig.register(CogformerConfig.model_type, CogformerConfig)
    except ValueError:  # already registered (module reloaded)
        pass
    try:
        AutoModelForCausalLM.register(CogformerConfig, CogformerForCausalLM)
    except ValueError:
        pass


register_auto_classes()
