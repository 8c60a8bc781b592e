"""What every Cog diffusers processor shares: the attention step (Cog or the stock call), the diffusers mask read as
a key padding mask, the head split and merge, and the kept-softmax twin of a processor class.

Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn

from uvic.attention import AttentionKind, Backend, cog_attention, kept_by_mask


# Additive mask entries at or below this remove a key (diffusers builds its masks with -10000.0).
REMOVED_KEY_BIAS = -10000.0


def key_padding_mask_from(attention_mask: torch.Tensor | None, where: str = "attention") -> torch.Tensor | None:
    """The (B, Lk) key padding mask (True = the key takes part) that a diffusers attention mask stands for.

    Supported: masks that remove keys, the same keys for every head and query. Boolean masks (True = keep, as
    SDPA reads them) or additive masks whose entries are 0 (keep) or at most REMOVED_KEY_BIAS / -inf (remove).

    Args:
        attention_mask: (B, nh | 1, Lq | 1, Lk) as the stock processor hands it to SDPA ((B, Lk) and (B, Lq | 1, Lk)
            are read as (B, 1, 1, Lk) and (B, 1, Lq | 1, Lk)), or None.
        where: the module's name, for the error message.
    Returns:
        (B, Lk) bool, or None when no key is removed.
    Raises:
        ValueError: any other mask (a bias, a per-query or per-head pattern), naming `where` and the supported kinds.
    """
    if attention_mask is None:
        return None
    supported = ("Cog attention supports masks that only remove keys: boolean (True = keep) or additive "
                 f"(0 = keep, <= {REMOVED_KEY_BIAS:g} or -inf = remove), the same for every head and query")
    if attention_mask.dim() in (2, 3):
        attention_mask = attention_mask[:, None, None] if attention_mask.dim() == 2 else attention_mask[:, None]
    if attention_mask.dim() != 4:
        raise ValueError(f"{where}: expected a (B, heads, Lq, Lk) mask, got shape {tuple(attention_mask.shape)}; "
                         f"{supported}")
    keep = kept_by_mask(attention_mask, REMOVED_KEY_BIAS)
    if keep is None:
        raise ValueError(f"{where}: the additive attention mask has entries other than 0 and "
                         f"<= {REMOVED_KEY_BIAS:g} (a bias, not a key mask); {supported}")
    if not (keep == keep[:, :1, :1, :]).all():
        raise ValueError(f"{where}: the attention mask differs between queries or heads; {supported}")
    kpm = keep[:, 0, 0, :]
    return None if bool(kpm.all()) else kpm


def split_blhd(x: torch.Tensor, nh: int) -> torch.Tensor:
    """(B, L, nh * hd) -> (B, L, nh, hd), the layout of `dispatch_attention_fn`."""
    return x.unflatten(-1, (nh, -1))


def split_heads(x: torch.Tensor, nh: int) -> torch.Tensor:
    """(B, L, nh * hd) -> (B, nh, L, hd), the layout of SDPA."""
    return split_blhd(x, nh).transpose(1, 2)


def qkv_heads(attn, to_q, to_k, to_v, norm_q, norm_k, x: torch.Tensor, context: torch.Tensor):
    """Queries from x (B, Lq, C), keys and values from context (B, Lk, C'), split into heads (B, nh, L, hd), with
    the optional q and k norms applied."""
    q, k, v = (split_heads(f(t), attn.heads) for f, t in ((to_q, x), (to_k, context), (to_v, context)))
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


def merge_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, nh, L, hd) -> (B, L, nh * hd) in `dtype`."""
    return x.transpose(1, 2).flatten(2).to(dtype)


class Attend:
    """The attention step shared by the processors: `cog_attention` (class attribute `attention = "cog"`) or the
    stock SDPA call ("softmax", the kept-softmax subclasses).

    Args:
        backend: the `uvic.attention.cog_attention` backend ("auto": the fused kernel on GPUs where it fits).
        name: the module's name, used in error messages.
    """

    attention: AttentionKind = "cog"

    def __init__(self, backend: Backend = "auto", name: str = "attention"):
        self.backend, self.name = backend, name

    @property
    def runs_softmax(self) -> bool:
        """True on a layer kept on softmax (the stock attention call), False on a Cog layer."""
        return self.attention == "softmax"

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
    ) -> torch.Tensor:
        """q (B, nh, Lq, hd), k and v (B, nh, Lk, hd), mask as SDPA takes it or None, scale of q k^T (None:
        hd ** -0.5) -> (B, nh, Lq, hd)."""
        if self.attention == "softmax":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale)
        kpm = key_padding_mask_from(mask, self.name)
        return cog_attention(q, k, v, key_padding_mask=kpm, scale=scale, backend=self.backend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(attention={self.attention!r}, backend={self.backend!r}, name={self.name!r})"


class Dispatch(Attend):
    """`Attend` for processors that call diffusers' `dispatch_attention_fn` in the (B, L, nh, hd) layout."""

    # Set by diffusers' `set_attention_backend`; the softmax mode passes them on as the stock processor does.
    _attention_backend = None
    _parallel_config = None

    def attend_blhd(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, parallel_config=None
    ) -> torch.Tensor:
        """q (B, Lq, nh, hd), k and v (B, Lk, nh, hd) -> (B, Lq, nh, hd)."""
        if self.attention == "softmax":
            return dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                         backend=self._attention_backend, parallel_config=parallel_config)
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)


class LayerScale:
    """The q k^T scale of processors that stand for both an SDPA processor (scale hd ** -0.5) and its explicit
    twin (`AttnProcessor`, `AttnAddedKVProcessor`: the layer's `attn.scale`, 1 for layers built with
    `scale_qk=False`).

    Args:
        layer_scale: True: `attn.scale`; False: hd ** -0.5; None (the default, and what a re-created processor
            gets): as the layer's default processor, i.e. `attn.scale` on `scale_qk=False` layers, else hd ** -0.5.
    """

    def __init__(self, backend: Backend = "auto", name: str = "attention", layer_scale: bool | None = None):
        super().__init__(backend, name)
        self.layer_scale = layer_scale

    def scale_for(self, attn) -> float | None:
        """The scale to pass to `attend` (None: hd ** -0.5, SDPA's default)."""
        use_layer = not getattr(attn, "scale_qk", True) if self.layer_scale is None else self.layer_scale
        return attn.scale if use_layer else None

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, layer_scale={self.layer_scale})"


def prepare_mask(attn, attention_mask: torch.Tensor | None, context: torch.Tensor) -> torch.Tensor | None:
    """The mask as the stock SDPA processors hand it to SDPA: `attention_mask` as diffusers passes it, for the keys
    of `context` (B, Lk, C) -> (B, nh, Lq | 1, Lk), or None."""
    if attention_mask is None:
        return None
    batch_size, sequence_length, _ = context.shape
    attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
    return attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])


def kept_softmax(cog: type) -> type:
    """The kept-softmax twin of the Cog processor class `cog`: the same computation with the stock attention call,
    as a class of its own (`KeptSoftmax<Name>AttnProcessor` for `Cog<Name>AttnProcessor`) so that re-creating a
    processor as `processor.__class__()` keeps the mode."""
    name = cog.__name__.replace("Cog", "KeptSoftmax", 1)
    doc = f"`{cog.__name__}` on a layer kept on softmax: exactly the stock processor's computation."
    return type(name, (cog,), {"attention": "softmax", "__doc__": doc, "__module__": cog.__module__,
                               "__qualname__": name})
