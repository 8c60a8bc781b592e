"""Tiny model configs shared by several test folders (importable because tests/conftest.py puts tests/ on sys.path).

A plain module rather than `conftest`: every test folder has its own conftest.py, so `from conftest import ...`
resolves to whichever one pytest imported first.
"""

# A tiny SD-style VAE (16x16 images -> 4x8x8 latents) for text-to-image tests.
VAE_TINY = {"block_out_channels": (8, 16), "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 16}
