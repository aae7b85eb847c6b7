"""The top-level config a user writes: which strategy, which plan, which policy, which overrides.

Validation order matters and is deliberate: ``strategy`` first, because it selects the policy model that
``policy`` is validated against and says whether a ``plan`` is needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import (
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticKnownError

from overlapcfg.config.base import ConfigModel, measured
from overlapcfg.config.boundary import Mount
from overlapcfg.config.contracts import contract_of, strategy_names
from overlapcfg.config.plan import DEPTH_FIELDS, Bucket, BucketPlan, ModuleOverride
from overlapcfg.config.policy import OverlapPolicy, PolicyBase
from overlapcfg.config.presets import load_preset, preset_names
from overlapcfg.config.safe_yaml import dump_yaml
from overlapcfg.errors import closest_first, did_you_mean, join_path, show_value

__all__ = ["OverlapConfig", "Setting", "Site"]

Site: TypeAlias = Literal["policy", "plan", "overrides"]
"""Where a config writes depths: the policy, a plan entry written as a mapping, an override."""
SITES: tuple[Site, ...] = ("policy", "plan", "overrides")


@dataclass(frozen=True, slots=True)
class Setting:
    """One value a config writes at one of its sites (``OverlapConfig.settings``)."""

    loc: tuple[str | int, ...]
    """From the overlap node: ``("plan", "buckets", 1, "forward_prefetch")``."""
    value: Any

    @property
    def key(self) -> str:
        return str(self.loc[-1])

    def path(self, root: str = "") -> str:
        """The dotted path from the config node (``overrides[0].all_reduce_delay``), or from ``root`` where given
        (``trainer.overlap.overrides[0].all_reduce_delay``; ``overlapcfg.config.boundary`` does that for faults)."""
        return join_path(root, self.loc)


class OverlapConfig(ConfigModel):
    """Everything overlapcfg needs to rewrite a graph. Load one with ``overlapcfg.load_config``."""

    strategy: str = "manual"
    """A registered strategy name (``overlapcfg.available_strategies()``): ``manual``, ``torch_manual``,
    ``auto``, ``none``, or one registered by a third-party package."""

    plan: BucketPlan | None = Field(None, validate_default=True)
    """Which modules share a bucket: a mapping, or the name of a shipped preset (``llama_layers``). Required by
    strategies that bucket by plan (``manual``, ``torch_manual``); others may leave it out."""

    policy: SerializeAsAny[PolicyBase] = Field(None, validate_default=True)
    """Depths and limits, validated against the strategy's own policy model; defaults to that model's defaults.
    A preset name (``aggressive``), or a mapping. A policy that belongs to another strategy says so with a
    ``strategy`` key (the ``auto`` preset has ``strategy: auto``): choosing it selects that strategy where the
    strategy is the default ``manual``, and is an error against any other."""

    overrides: tuple[ModuleOverride, ...] = ()
    """Per-module depths; each applies to the buckets holding a module it matches, later entries win."""

    verify: bool = True
    """Prove every rewritten graph (``overlapcfg.verify``: lint, waits, data dependencies, the same parameter
    elements gathered and gradients reduced with the same group, size, op and dtype) before it is returned; a
    failure raises and leaves the graph as it was. Costs a fraction of the pass; false only to measure the pass."""

    strict: bool = False
    """Make it an error, not a warning, when the plan resolves but no FSDP collective of the graph lands in any
    bucket (FSDP2's eager collectives, an unsupported sharder, missing metadata)."""

    check_same_schedule: bool = True
    """Before the first step, compare the collectives every rank will issue (each compiled graph's, each
    ``fully_shard`` call's) across the ranks of each process group, and raise ``SameScheduleError`` on every rank
    where they differ, naming the ranks and the first differing collective, instead of hanging in it until the
    backend's timeout (``overlapcfg.graph.same_schedule``). Runs wherever a real process group of more than one
    rank exists; false skips it, and the record says so."""

    same_schedule_timeout_s: Annotated[float, measured("seconds", 1.0, 86400.0, example="1 s to a day")] = 300.0
    """How long the same-schedule check waits for the other ranks of a group to reach it before it raises, naming
    the ranks that did not (a rank that crashed earlier, or that compiles much longer): the bound on how long a
    missing rank can keep the others waiting there."""

    _mount: Mount = PrivateAttr(default_factory=Mount)

    @property
    def mount(self) -> Mount:
        """Where this config came from: the path where the user mounted it (``trainer.overlap``) and the file it
        was read from, so that errors found later (a plan pattern that matches no module of the model) name what
        the user wrote (``overlapcfg.config.boundary``). Set by ``load_config(root=...)`` and ``from_hydra``; not
        part of the config's value (equal configs compare equal wherever they came from)."""
        return self._mount

    @property
    def config_root(self) -> str:
        """``mount.path``: where the user mounted this config (``trainer.overlap``)."""
        return self._mount.path

    def mounted_at(self, root: str, *, file: str | None = None) -> OverlapConfig:
        """This config, remembered as mounted at ``root`` and read from ``file`` (a copy; the value is unchanged)."""
        copy = self.model_copy()
        copy._mount = Mount(root, file)
        return copy

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = ConfigModel.__hash__

    @model_validator(mode="before")
    @classmethod
    def _strategy_of_policy(cls, data: Any) -> Any:
        """``policy: auto`` (by name, or the group option a Hydra app selected, mounted anywhere) selects strategy
        ``auto`` where the strategy is the default ``manual``: Hydra always writes ``strategy: manual`` from the
        group's default, so "left at the default" and "written as manual" cannot be told apart there, and both
        mean "no other strategy chosen". A strategy other than the default that disagrees stays, and the policy
        reports the contradiction at its own path."""
        if not isinstance(data, Mapping):
            return data
        wanted = _policy_strategy(data.get("policy"))
        default = cls.model_fields["strategy"].default
        if wanted is not None and data.get("strategy", default) == default:
            return {**data, "strategy": wanted}
        return data

    @field_validator("strategy", mode="after")
    @classmethod
    def _known_strategy(cls, name: str) -> str:
        names = strategy_names()
        if name not in names:
            raise PydanticCustomError(
                "unknown_strategy",
                "unknown strategy {name}; available (closest first): {names}{hint}",
                {"name": show_value(name), "names": _listing(closest_first(name, names)),
                 "hint": did_you_mean(name, names)},
            )
        return name

    @field_validator("plan", mode="before")
    @classmethod
    def _plan_preset(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            strategy = info.data.get("strategy")
            if strategy is not None and contract_of(strategy).uses_plan:
                raise PydanticCustomError(
                    "plan_required",
                    "strategy {strategy} needs a plan: a preset name ({presets}) or a mapping with 'buckets'",
                    {"strategy": repr(strategy), "presets": ", ".join(preset_names("plan"))},
                )
            return None
        if not isinstance(value, str):
            return _renamed_if_modified(value)
        try:
            data = load_preset("plan", value)
        except KeyError:
            names = preset_names("plan")
            raise PydanticCustomError(
                "unknown_preset",
                "unknown plan preset {name}; available (closest first): {names}{hint}",
                {"name": show_value(value), "names": _listing(closest_first(value, names)),
                 "hint": did_you_mean(value, names)},
            ) from None
        data.setdefault("name", value)
        return data

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_of_strategy(cls, value: Any, info: ValidationInfo) -> Any:
        strategy = info.data.get("strategy")
        if strategy is None:  # the strategy itself is invalid; that fault is reported on its own
            return OverlapPolicy()
        model = contract_of(strategy).policy
        if value is None:
            return model()
        if isinstance(value, model):
            return value
        if isinstance(value, PolicyBase):
            value = value.model_dump(exclude_unset=True)
        if isinstance(value, str):
            value = _policy_preset(value, strategy)
        elif isinstance(value, Mapping) and "strategy" in value:
            value = _own_strategy(dict(value), strategy, "this policy")
        return model.model_validate(value)

    def settings(self, *keys: str, sites: tuple[Site, ...] = SITES) -> Iterator[Setting]:
        """Every value of ``keys`` this config writes, in the order written: the policy's, then each plan entry's
        (those written as a mapping), then each override's. A site without such a field, or leaving it unset
        (None), writes nothing; the policy always writes its fields (their defaults included).

        The one walk over the places a depth can be set: the strategy's rules below, the FSDP2 driver's checks
        and the pass's notes on settings a strategy ignores all read the config through it.
        """
        found: list[tuple[tuple[str | int, ...], Any]] = []
        if "policy" in sites:
            found.append((("policy",), self.policy))
        if "plan" in sites and self.plan is not None:
            found += [(("plan", "buckets", i), e) for i, e in enumerate(self.plan.buckets) if isinstance(e, Bucket)]
        if "overrides" in sites:
            found += [(("overrides", i), o) for i, o in enumerate(self.overrides)]
        for where, item in found:
            fields = type(item).model_fields
            for key in keys:
                if key in fields and (value := getattr(item, key)) is not None:
                    yield Setting((*where, key), value)

    @model_validator(mode="after")
    def _entries_within_policy(self) -> OverlapConfig:
        """A depth a plan entry or an override writes stands in for the policy's for those buckets, so it must be a
        value the strategy's policy model accepts: ``TorchManualPolicy`` fixes the depths at 1 and has no
        all-reduce delay, and that one rule holds in the policy, every plan entry and every override."""
        model = contract_of(self.strategy).policy
        fields = model.model_fields
        faults: list[InitErrorDetails] = []
        for setting in self.settings(*DEPTH_FIELDS, sites=("plan", "overrides")):
            if setting.key not in fields:
                continue  # the strategy has no policy value of that name: the resolved plan carries it as written
            faults += _as_policy_value(model, setting)
        if faults:
            raise ValidationError.from_exception_data("OverlapConfig", faults)
        return self

    def to_yaml(self) -> str:
        """YAML that ``load_config`` reads back to an equal config (strings YAML would read as something else,
        such as ``1e3``, ``yes`` or ``${x}``, are quoted)."""
        return dump_yaml(self.model_dump(mode="json"))


def _as_policy_value(model: type[PolicyBase], setting: Setting) -> list[InitErrorDetails]:
    """The faults of ``setting``'s value as ``model``'s field of the same name (its type, constraints and field
    validators; the rest of the model at its defaults), raised again at ``setting``'s location."""
    try:
        model.model_validate({setting.key: setting.value})
    except ValidationError as err:
        return [_raised_again(e, setting) for e in err.errors(include_url=False) if e["loc"][:1] == (setting.key,)]
    return []


def _raised_again(error: Any, setting: Setting) -> InitErrorDetails:
    """The policy model's error raised again at ``setting``'s location: the same type and context (so
    ``load_config`` words it as it would at the policy), or, for a validator's own error, its text."""
    try:
        PydanticKnownError(error["type"], error.get("ctx"))
    except KeyError:
        custom = PydanticCustomError(error["type"], "{msg}", {"msg": error["msg"]})
        return InitErrorDetails(type=custom, loc=(*setting.loc, *error["loc"][1:]), input=setting.value)
    found = InitErrorDetails(type=error["type"], loc=(*setting.loc, *error["loc"][1:]), input=setting.value)
    if "ctx" in error:
        found["ctx"] = error["ctx"]
    return found


def _policy_strategy(policy: Any) -> str | None:
    """The strategy a policy belongs to, where it says: a mapping's ``strategy`` key, or a preset's (a preset
    written at the overlap node, ``strategy`` + ``policy``, as user apps may still have, counts too)."""
    if isinstance(policy, str):
        try:
            policy = load_preset("policy", policy)
        except KeyError:
            return None  # the policy's own validation names the unknown preset
    wanted = policy.get("strategy") if isinstance(policy, Mapping) else None
    return wanted if isinstance(wanted, str) else None


def _own_strategy(data: dict[str, Any], strategy: str, what: str) -> dict[str, Any]:
    """``data`` without its ``strategy`` key, which must be the config's strategy."""
    wanted = data.pop("strategy")
    if wanted != strategy:
        raise PydanticCustomError(
            "preset_strategy", "{what} is for strategy {wanted}, but the strategy is {strategy}; choose one: "
            "strategy: {wanted} (with this policy) or another policy", {"what": what, "wanted": repr(wanted),
                                                                       "strategy": repr(strategy)})
    return data


def _policy_preset(name: str, strategy: str) -> dict[str, Any]:
    """A policy written as a name is a shipped preset (``overlap/policy/<name>.yaml``), like a plan.

    A preset that belongs to another strategy (``auto``: ``strategy: auto`` among its fields) has selected it
    already where the strategy was the default (``OverlapConfig._strategy_of_policy``); against another strategy
    it is an error.
    """
    try:
        data = load_preset("policy", name)
    except KeyError:
        names = preset_names("policy")
        raise PydanticCustomError(
            "unknown_preset", "unknown policy preset {name}; available (closest first): {names}{hint}",
            {"name": show_value(name), "names": _listing(closest_first(name, names)),
                 "hint": did_you_mean(name, names)},
        ) from None
    if "policy" in data and isinstance(data["policy"], dict):  # written at the overlap node
        data = {**data["policy"], **({"strategy": data["strategy"]} if "strategy" in data else {})}
    return _own_strategy(dict(data), strategy, f"policy preset {name!r}") if "strategy" in data else data


def _listing(names: list[str], limit: int = 5) -> str:
    """The first ``limit`` names (closest first), then how many there are: an error line stays one line."""
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _renamed_if_modified(value: Any) -> Any:
    """A plan named after a shipped preset but holding other buckets (Hydra keeps the preset's ``name`` when
    ``overlap.plan.buckets=[...]`` is overridden) is no longer that preset: reports must not title it so."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or "buckets" not in value:
        return value
    name = value["name"]
    if name not in preset_names("plan"):
        return value
    try:  # compare what the entries mean, not how they were written (a dump spells out every default)
        given = BucketPlan.model_validate({"buckets": value["buckets"]}).buckets
        shipped = BucketPlan.model_validate({"buckets": load_preset("plan", name).get("buckets", [])}).buckets
    except ValueError:
        return value  # invalid entries: the plan's own validation reports them
    return value if given == shipped else {**value, "name": f"{name} (modified)"}
