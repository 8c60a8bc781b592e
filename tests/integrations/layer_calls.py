"""Helpers shared by the diffusers integration tests: a model's attention layers, and one forward pass that records
what each of them was called with and returned, so a test can call the layer again with another processor."""

import torch


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules of `model` that run a diffusers attention processor, by name."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "processor") and hasattr(m, "set_processor")}


def recorded_run(model: torch.nn.Module, inputs: dict, output=lambda out: out.sample):
    """Run `model(**inputs)` with forward hooks that store each attention layer's (args, kwargs, output); returns
    ({name: (args, kwargs, output)}, output(model's result)). The hooks are removed afterwards."""
    calls = {}

    def hook(name):
        def record(module, args, kwargs, out):
            calls[name] = (args, kwargs, out)  # returns None: the output is left as it is
        return record

    handles = [m.register_forward_hook(hook(name), with_kwargs=True) for name, m in attention_layers(model).items()]
    try:
        result = output(model(**inputs))
    finally:
        for h in handles:
            h.remove()
    return calls, result


def outputs(out) -> tuple:
    """A layer's output as a tuple (joint layers return (hidden_states, context))."""
    return out if isinstance(out, tuple) else (out,)
