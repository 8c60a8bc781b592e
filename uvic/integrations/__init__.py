"""Cog attention in other libraries' models: `uvic.integrations.diffusers` and `uvic.integrations.transformers`.

Each submodule imports its library; import the one you need (this package imports neither).
"""
