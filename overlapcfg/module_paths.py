"""Module paths: the dotted FQNs users write, how the paths torch shows are turned into them, how they nest, and
the facts about a model that plans are resolved against (``ModelFacts``). The one home of these rules, torch-free
and below every layer: plan patterns (``overlapcfg.config.patterns``), plan resolution, attribution, the backend,
the FSDP2 driver and the tuner all read them from here.

- Wrappers: ``_orig_mod`` (``torch.compile``), ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module`` are not
  part of the FQN a user thinks in (``strip_wrappers``); neither are parametrization internals (``user_fqn``) nor
  the dynamo source syntax module stacks and inputs are spelled in (``clean_path``).
- Nesting is by whole segments: ``layers.10`` is not inside ``layers.1`` (``is_inside``, ``ancestors``).
- A parameter's owner is the module holding it directly (``parameter_owner``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from overlapcfg.errors import natural_key

__all__ = [
    "WRAPPER_SEGMENTS",
    "ModelFacts",
    "ancestors",
    "clean_path",
    "is_inside",
    "normalize_fqns",
    "parameter_owner",
    "split_fqn",
    "strip_wrappers",
    "user_fqn",
    "with_parents",
]

WRAPPER_SEGMENTS: tuple[str, ...] = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Segments inserted by ``torch.compile``, activation checkpointing and FSDP1 wrappers; never matched."""


def split_fqn(fqn: str) -> tuple[str, ...]:
    """Segments of an FQN; the root module ``""`` has none (``"".split(".")`` would give one empty segment)."""
    return tuple(fqn.split(".")) if fqn else ()


def strip_wrappers(fqn: str) -> str:
    """``_orig_mod.layers.0._checkpoint_wrapped_module.attention`` -> ``layers.0.attention``."""
    if not any(w in fqn for w in WRAPPER_SEGMENTS):
        return fqn
    return ".".join(p for p in split_fqn(fqn) if p not in WRAPPER_SEGMENTS)


def normalize_fqns(fqns: Iterable[str]) -> tuple[str, ...]:
    """Wrapper-stripped FQNs in first-seen order, duplicates dropped.

    A compiled model lists both ``""`` and ``_orig_mod``, which are the same module once stripped.
    """
    return tuple(dict.fromkeys(strip_wrappers(f) for f in fqns))


def is_inside(fqn: str, ancestor: str) -> bool:
    """Whether ``fqn`` is ``ancestor`` or nested in it, by whole segments: ``layers.10`` is not in ``layers.1``.

    Every module is inside the root ``""``.
    """
    return not ancestor or fqn == ancestor or fqn.startswith(ancestor + ".")


def ancestors(fqn: str) -> list[str]:
    """Proper ancestors, outermost first: ``a.b.c`` -> ``["", "a", "a.b"]``; the root has none."""
    parts = split_fqn(fqn)
    return [".".join(parts[:i]) for i in range(len(parts))]


def with_parents(fqns: Iterable[str]) -> tuple[str, ...]:
    """``fqns`` and every module above them, natural order: the module tree plan patterns are matched against
    when only some of a model's modules are visible (those on module stacks, those owning parameters)."""
    closed: dict[str, None] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        for i in range(1, len(parts) + 1):
            closed.setdefault(".".join(parts[:i]))
    return tuple(sorted(closed, key=natural_key))


def parameter_owner(param_fqn: str) -> str:
    """``layers.0.wq.weight`` -> ``layers.0.wq``."""
    return param_fqn.rpartition(".")[0]


_PARAMETRIZATIONS = "parametrizations"


def user_fqn(fqn: str) -> str:
    """Parametrization internals and wrapper segments removed.

    ``layers.0.wq.parametrizations.weight.original`` -> ``layers.0.wq.weight`` (a parameter);
    ``layers.0.wq.parametrizations.weight.0`` -> ``layers.0.wq`` (the parametrization module: its owner);
    ``_orig_mod.norm`` -> ``norm``.
    """
    parts = [s for s in fqn.split(".") if s and s not in WRAPPER_SEGMENTS]
    if _PARAMETRIZATIONS not in parts:
        return ".".join(parts)
    cut = parts.index(_PARAMETRIZATIONS)
    owner, rest = parts[:cut], parts[cut + 1:]
    if len(rest) >= 2 and rest[1].startswith("original"):
        owner.append(rest[0])
    return ".".join(owner)


_ROOT = re.compile(r"^(?:[LG]\[(?:'[^']*'|\"[^\"]*\")\](?:\[(?:'[^']*'|\"[^\"]*\"|\d+)\])*|self)")
_TOKEN = re.compile(r"\.(\w+)|\[(?:'([^']*)'|\"([^\"]*)\"|(\d+))\]")
_CONTAINERS = frozenset({"_modules", "_parameters", "_buffers"})
_NOT_A_MODULE_PATH = ("type(", "__dict__", ".fget", "getattr(", "(")


def clean_path(path: str) -> str | None:
    """A dynamo source or module-stack path as the dotted FQN a user writes; ``None`` if it is not a module path.

    ``L['args'][0].model.layers.0.self_attn`` -> ``model.layers.0.self_attn``;
    ``L['self'].layers.0.forward.__closure__[1].cell_contents.__self__.attention`` -> ``layers.0.attention``;
    ``L['self']._modules['layers']._modules['0']._modules['wq']._parameters['weight']`` -> ``layers.0.wq.weight``;
    ``dict(type(L['self'].layers.0).__dict__)['weight'].fget`` -> ``None``.
    """
    if any(marker in path for marker in _NOT_A_MODULE_PATH):
        return None
    root = _ROOT.match(path)
    rest = path[root.end():] if root else path
    if rest and rest[0] not in ".[":
        rest = "." + rest
    tokens = [next(g for g in m.groups() if g is not None) for m in _TOKEN.finditer(rest)]
    if "".join(f".{t}" for t in tokens).replace(".", "") != re.sub(r"[.\[\]'\"]", "", rest):
        return None  # something we do not understand sits in the path: do not guess
    parts: list[str] = []
    skip_index = False
    for i, token in enumerate(tokens):
        if skip_index and token.isdecimal():  # the cell number after __closure__
            skip_index = False
            continue
        skip_index = token == "__closure__"
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token.startswith("__") or token == "cell_contents" or token in _CONTAINERS:
            continue
        if following in ("__closure__", "__func__", "__wrapped__"):  # a method name, not a module
            continue
        parts.append(token)
    return user_fqn(".".join(parts))


class _Model(Protocol):
    """What ``ModelFacts.of`` reads of a model (an ``nn.Module``; typed structurally so this module needs no
    torch)."""

    def named_modules(self) -> Iterable[tuple[str, Any]]: ...

    def named_parameters(self, prefix: str = ..., recurse: bool = ...,
                         remove_duplicate: bool = ...) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a config's plan is resolved against: a model's modules and parameter owners, as user FQNs.

    Made from a live model (``ModelFacts.of``), from what a traced step saw (``CapturedStep.facts``), or by hand
    where only the names are known.
    """

    modules: tuple[str, ...]
    """Module FQNs in ``named_modules()`` order (wrappers and parametrization internals removed; no root)."""
    owners: tuple[str, ...] | None = None
    """FQNs of the modules holding a trainable parameter directly (a shared one: where it is first named), what
    plan coverage counts; None: unknown."""
    params: tuple[str, ...] = ()
    """Parameter FQNs in ``named_parameters()`` order, shared ones once (their first name)."""
    types: tuple[str, ...] = ()
    """The class name of each of ``modules`` (same order; a wrapper names what it wraps); empty where unknown."""

    @classmethod
    def of(cls, model: _Model) -> ModelFacts:
        """The facts of a live model (an ``nn.Module``): its modules, the owners of its trainable parameters, its
        parameters and module classes, all by user FQN."""
        modules: dict[str, str] = {}
        for name, module in model.named_modules():
            fqn = clean_path(name) or ""
            if not fqn:
                continue
            if _PARAMETRIZATIONS in name.split("."):  # cleans to its owner's path, and is not the owner
                modules.setdefault(fqn, "")
            else:
                modules[fqn] = type(module).__name__  # the innermost under a cleaned path: what a wrapper wraps
        params = tuple(dict.fromkeys(clean_path(name) or name
                                     for name, _ in model.named_parameters(remove_duplicate=False)))
        owners = tuple(dict.fromkeys(parameter_owner(clean_path(name) or name) for name, p in model.named_parameters()
                                     if getattr(p, "requires_grad", True)))  # a shared parameter: its first owner
        return cls(tuple(modules), owners, params, tuple(modules.values()))
