"""The model's parameter bindings (module, attribute -> Parameter) as the engine found them at initialize.

The engine's hooks, buckets and unit shards belong to the Parameter objects it was given. One
put in their place afterwards (`module.load_state_dict(sd, assign=True)`, `module.w =
nn.Parameter(...)`) has none of them: the forward would use it, its gradient would reach nothing,
and the original would be stepped with a zero gradient, so training would silently stop. Which
parameters train is fixed then too: one frozen afterwards would still be stepped (Adam's moments
keep moving it), one unfrozen would gather .grad that nothing steps. Both are refused before a
backward reduces anything.
"""
from __future__ import annotations

from torch import nn

from zero_offload.config import ConfigError

# (module, attribute, qualified name, parameter, whether it trained at initialize)
Binding = tuple[nn.Module, str, str, nn.Parameter, bool]


def param_bindings(model: nn.Module) -> list[Binding]:
    """Every (module, attribute) holding a parameter now, with its qualified name."""
    return [(mod, attr, f"{prefix}.{attr}" if prefix else attr, p, p.requires_grad)
            for prefix, mod in model.named_modules(remove_duplicate=False)
            for attr, p in mod._parameters.items() if p is not None]


def check_bindings(bindings: list[Binding]) -> None:
    """Refuse a binding whose parameter is no longer the object initialize saw, or no longer
    trains (or now trains) where it did not."""
    for mod, attr, name, p, trained in bindings:
        if p.requires_grad != trained:
            raise RuntimeError(f"engine.backward: parameter '{name}' was {'unfrozen' if p.requires_grad else 'frozen'} "
                               f"(requires_grad={p.requires_grad}) after initialize; the trainable parameters are fixed "
                               "then: change it before initialize (or build a new engine)")
        # `in` and [], not .get: a ScriptModule's _parameters is an OrderedDictWrapper without it.
        if (mod._parameters[attr] if attr in mod._parameters else None) is not p:
            raise RuntimeError(f"engine.backward: parameter '{name}' was replaced by another object after "
                               "initialize (load_state_dict(assign=True), or a new nn.Parameter); the engine trains "
                               "the original: copy new values into it in place instead (with torch.no_grad(): "
                               "p.copy_(new)), or load them before initialize")


def refuse_sparse_gradients(model: nn.Module) -> None:
    """An embedding with sparse=True gives its weight a sparse gradient, which no flat buffer
    holds (torch's own AdamW refuses it too): one line at initialize, not a failure inside torch."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ConfigError(f"initialize: '{name}' ({type(m).__name__}) has sparse=True, whose sparse gradients "
                             "the engine cannot step (nor can torch.optim.AdamW): build it with sparse=False")
