"""CLIP text features for MS-COCO text-to-image, on open_clip (docs/conventions.md, "Text encoder").

U-ViT conditions on `CLIPTextModel("openai/clip-vit-large-patch14").last_hidden_state`: all 77 token features
after the final LayerNorm, (B, 77, 768), no attention mask. This module computes the same features with the
open_clip ViT-L/14 text tower and OpenAI weights:

* tokens: open_clip's `SimpleTokenizer` (its BPE vocabulary ships with the package, so tokenising needs no
  download), `[SOT] + bpe + [EOT]`, truncated to 77 with EOT kept last. open_clip pads with id 0 ("!"), but the
  official Hugging Face tokenizer pads with the end-of-text token 49407 (`pad_token="<|endoftext|>"`). Under
  the causal mask the padded positions' features depend on the pad id, and U-ViT feeds all 77 positions to
  the network, so we pad with EOT (`pad_token_id`). tests/models/test_text_encoder.py checks the ids against
  transformers' `CLIPTokenizer` built on the same vocabulary and called exactly as U-ViT's `FrozenCLIPEmbedder`.
* features: token embedding + positional embedding -> causal pre-LN transformer (QuickGELU, as OpenAI CLIP)
  -> `ln_final`, no pooling or projection. The test copies a random tower into transformers' `CLIPTextModel`
  and compares `last_hidden_state`.

Shape letters: B batch, L = 77 tokens, D width (768 for ViT-L/14).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
from pathlib import Path

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from uvic.io import check_model_dir


logger = logging.getLogger(__name__)

__all__ = ["CLIPTextEncoder", "tokenize", "load_clip_state_dict"]

EOT_TOKEN_ID = 49407  # "<|endoftext|>" in the OpenAI CLIP vocabulary; also the official pad id


@functools.lru_cache(maxsize=1)
def _simple_tokenizer():
    """open_clip's OpenAI BPE tokenizer (vocabulary file bundled with open_clip; built once)."""
    from open_clip.tokenizer import SimpleTokenizer

    return SimpleTokenizer()


def tokenize(texts: str | list[str], context_length: int = 77, pad_token_id: int = EOT_TOKEN_ID) -> torch.Tensor:
    """Tokenise like U-ViT's `FrozenCLIPEmbedder` (HF CLIPTokenizer, padding="max_length", truncation=True).

    Args:
        texts: one string or a list of B strings.
    Returns:
        (B, context_length) int64 ids: SOT, BPE tokens, EOT, then `pad_token_id` up to `context_length`.
    """
    tok = _simple_tokenizer()
    ids = tok(texts, context_length=context_length)  # zero-padded after EOT
    # Everything after the first EOT is padding: replace open_clip's 0 with the official pad id.
    is_eot = ids == tok.eot_token_id
    after_eot = (is_eot.cumsum(dim=1) - is_eot.long()) > 0
    return ids.masked_fill(after_eot, pad_token_id)


def load_clip_state_dict(path: str | os.PathLike, trust_torchscript: bool = False) -> dict[str, torch.Tensor]:
    """State dict of a CLIP checkpoint file in open_clip's formats (.safetensors, or .bin/.pt state dicts read with
    `torch.load(weights_only=True)`). A TorchScript archive (OpenAI's `ViT-L-14.pt`) holds code, which loading it
    runs: it is refused unless `trust_torchscript=True` (only for a file from a source you trust; docs/security.md)."""
    from open_clip.factory import load_state_dict

    from uvic.io import weights_only_error

    try:
        return load_state_dict(str(path), weights_only=True)
    except pickle.UnpicklingError as e:
        raise weights_only_error(path, e, "CLIP checkpoint") from e
    except RuntimeError as e:
        if "TorchScript" not in str(e):
            raise
        if not trust_torchscript:
            raise ValueError(f"{path} is a TorchScript archive, which is not loaded because loading it runs the code "
                             f"it holds; use open_clip's safetensors weights (from_open_clip(pretrained='openai') "
                             f"fetches them), or load_clip_state_dict(path, trust_torchscript=True) for a file you "
                             f"trust") from e
        return torch.jit.load(str(path), map_location="cpu").state_dict()


class CLIPTextEncoder(ModelMixin, ConfigMixin):
    """The open_clip text tower returning per-token features after the final LayerNorm.

    Build the real encoder with `CLIPTextEncoder.from_open_clip()` (ViT-L/14, OpenAI weights); the constructor
    alone gives a randomly initialised tower of the configured size (tests use a tiny one). It saves and loads
    with `save_pretrained` / `from_pretrained`, so it can be a pipeline component.

    Args:
        vocab_size, context_length, width, heads, layers, mlp_ratio: text-tower size (ViT-L/14 defaults).
        quick_gelu: OpenAI CLIP weights were trained with QuickGELU (x * sigmoid(1.702 x)).
        pad_token_id: id placed after EOT by `encode_text` (49407, the official scheme).
    """

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 49408,
        context_length: int = 77,
        width: int = 768,
        heads: int = 12,
        layers: int = 12,
        mlp_ratio: float = 4.0,
        quick_gelu: bool = True,
        pad_token_id: int = EOT_TOKEN_ID,
    ) -> None:
        super().__init__()
        import torch.nn as nn
        from open_clip.transformer import QuickGELU, TextTransformer

        self.text = TextTransformer(
            context_length=context_length,
            vocab_size=vocab_size,
            width=width,
            heads=heads,
            layers=layers,
            mlp_ratio=mlp_ratio,
            output_dim=None,  # no projection: we want token features, not the pooled embedding
            proj_type="none",
            act_layer=QuickGELU if quick_gelu else nn.GELU,
            output_tokens=True,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input_ids: (B, L) int64 token ids (from `tokenize`).
        Returns:
            (B, L, D) token features after `ln_final` (= CLIPTextModel.last_hidden_state).
        """
        _, tokens = self.text(input_ids)
        return tokens

    @torch.no_grad()
    def encode_text(self, texts: str | list[str]) -> torch.Tensor:
        """Tokenise with the official padding and encode. Returns (B, L, D) on the module's device and dtype."""
        ids = tokenize(texts, self.config.context_length, self.config.pad_token_id).to(self.device)
        return self(ids)

    @classmethod
    def from_open_clip(
        cls,
        pretrained: str | os.PathLike = "openai",
        model_name: str = "ViT-L-14",
        cache_dir: str | os.PathLike | None = None,
        quick_gelu: bool | None = None,
    ) -> CLIPTextEncoder:
        """Load the text tower of an open_clip checkpoint (by default ViT-L/14 with OpenAI weights).

        Args:
            pretrained: an open_clip tag ("openai": fetched through open_clip's cache, downloaded if online) or a
                local checkpoint file (an open_clip state dict or safetensors file; OpenAI's TorchScript `ViT-L-14.pt`
                holds code and is refused, see `load_clip_state_dict`).
            model_name: open_clip architecture name.
            cache_dir: open_clip / Hugging Face cache directory (None: the default cache).
            quick_gelu: activation of the checkpoint; None takes it from the tag's config, and assumes True (OpenAI)
                for a local file.
        Raises:
            FileNotFoundError: the weights are neither a local file nor in the cache and cannot be downloaded.
        """
        import open_clip

        model_cfg = open_clip.get_model_config(model_name)
        if model_cfg is None:
            raise ValueError(f"unknown open_clip model {model_name!r}")
        path = Path(pretrained)
        if path.is_file():
            checkpoint = str(path)
            quick_gelu = True if quick_gelu is None else quick_gelu
        else:
            tag_cfg = open_clip.get_pretrained_cfg(model_name, str(pretrained))
            if not tag_cfg:
                raise FileNotFoundError(
                    f"{pretrained!r} is neither a local checkpoint file nor an open_clip pretrained tag of "
                    f"{model_name} (tags: {open_clip.list_pretrained_tags_by_model(model_name)})"
                )
            try:
                checkpoint = open_clip.download_pretrained(tag_cfg, cache_dir=None if cache_dir is None else str(cache_dir))
            except Exception as e:  # hub/url errors differ by version; all mean "not available here"
                raise FileNotFoundError(
                    f"could not load open_clip {model_name} '{pretrained}' weights: not in the cache "
                    f"({cache_dir or 'default Hugging Face cache'}) and the download failed ({type(e).__name__}: "
                    f"{e}). Download them once with network access (e.g. "
                    f"`python -c \"import open_clip; open_clip.create_model('{model_name}', pretrained='{pretrained}')\"`) "
                    f"or pass the local checkpoint file (e.g. ViT-L-14.pt) as `pretrained`."
                ) from e
            if not checkpoint:
                raise FileNotFoundError(f"open_clip returned no file for {model_name} '{pretrained}'")
            quick_gelu = bool(tag_cfg.get("quick_gelu", False)) if quick_gelu is None else quick_gelu
        text_cfg = model_cfg["text_cfg"]
        encoder = cls(
            vocab_size=text_cfg["vocab_size"],
            context_length=text_cfg["context_length"],
            width=text_cfg["width"],
            heads=text_cfg["heads"],
            layers=text_cfg["layers"],
            mlp_ratio=text_cfg.get("mlp_ratio", 4.0),
            quick_gelu=quick_gelu,
        )
        encoder.load_text_state_dict(load_clip_state_dict(checkpoint))
        logger.info("loaded open_clip %s text tower from %s", model_name, checkpoint)
        return encoder.eval().requires_grad_(False)

    @classmethod
    def from_spec(cls, spec: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> CLIPTextEncoder:
        """The encoder `spec` names: a `save_pretrained` directory, else an open_clip tag or checkpoint file
        (`from_open_clip`); in eval mode. The one loader behind `--clip` (the extractor's and `sample.py`'s) and
        `data.text_encoder`.

        Raises:
            ValueError: a directory that holds no loadable encoder (no or a damaged config or weights file, pickled
                weights that are not plain tensors, a config that does not fit the weights).
        """
        if not Path(spec).is_dir():
            return cls.from_open_clip(spec, cache_dir=cache_dir)
        what = f"the CLIP text encoder {spec}"
        check_model_dir(cls, spec, what)
        try:
            encoder = cls.from_pretrained(spec)
        except Exception as e:  # noqa: BLE001 - diffusers / safetensors / torch report a damaged file in many types
            raise ValueError(f"cannot load {what}, a file in it is missing or damaged "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from e
        return encoder.eval()

    def load_text_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the text-tower keys of a full open_clip CLIP state dict (vision keys and projections ignored)."""
        own = self.text.state_dict()
        picked = {k: v for k, v in state_dict.items() if k in own}
        missing = sorted(set(own) - set(picked))
        if missing:
            raise ValueError(f"checkpoint lacks text-tower keys {missing[:5]}{'...' if len(missing) > 5 else ''}")
        self.text.load_state_dict(picked, strict=True)
