"""uvic: Cog attention (signed softmax attention, ICML 2025), U-ViC diffusion models and Cogformer LMs."""

from pathlib import Path as _Path


# kernels/ and fid/ sit beside uvic/ in the repository and are installed as uvic.kernels / uvic.fid
# (pyproject `package-dir`). When uvic is imported straight from a checkout (repo root on sys.path, e.g.
# `python train.py`), mirror that mapping so `uvic.kernels` and `uvic.fid` resolve to the same folders.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821  (the package's own __path__)

from uvic.attention import attention_ref, cog_attention, softmax_attention  # noqa: E402


__version__ = "0.1.0"
__all__ = ["cog_attention", "softmax_attention", "attention_ref", "__version__"]
