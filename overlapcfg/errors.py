"""The errors users see: one family under ``OverlapcfgError`` (catch it to catch every error overlapcfg raises on
purpose), plus the helpers that word them (closest names, shortened values, dotted paths).

- ``OverlapConfigError`` (a ``ValueError``): a value a user gave is wrong: a config, a setting, an argument, a file
  read. Its faults are data (``.faults``: dotted path, message), one line each, all at once; nothing is applied.
- ``OverlapUsageError`` (a ``TypeError``): an API called wrongly: a wrong type, a missing or contradictory argument.
- ``OverlapStateError`` (a ``RuntimeError``): called where it cannot work: no process group, nothing compiled yet,
  a model already sharded, a name already registered.
- ``OverlapLookupError`` (a ``KeyError``): no bucket, graph, row or depth of that name; the message lists those
  there are.
- ``UnsupportedGraphError`` (a ``RuntimeError``): a graph the pass cannot handle correctly; it is returned
  untouched, never half-rewritten.
- ``UpstreamPassError`` (a ``RuntimeError``): torch's own pass (strategies ``auto`` and ``torch_manual``) failed
  on this graph; torch's error is its cause, the graph is returned untouched.
- ``AttributionError`` (a ``RuntimeError``): the evidence of which parameter a collective carries disagrees.
- ``OverlapVerificationError`` (a ``RuntimeError``): a transformed graph broke an invariant; names the nodes.
- ``RankFailedError`` (a ``RuntimeError``): a rank of a multi-process run (``overlapcfg.demo.gloo``) raised, or the
  run timed out; the message holds the rank's traceback.
- ``SameScheduleError`` (a ``RuntimeError``): the ranks of a process group would issue different collectives (or a
  rank never reached the check); raised on every rank, naming the ranks and the first differing collective.

Each keeps the builtin its kind was raised as before the family existed, so ``except ValueError`` and the like
still catch what they caught. What is left a bare ``AssertionError`` is a bug check on overlapcfg's own
invariants (a scheduler that leaves nodes unplaced, a merge whose inputs the classification already guaranteed),
never a user's mistake.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "SHOWN_FAULTS",
    "SHOWN_PATHS",
    "AttributionError",
    "Fault",
    "OverlapConfigError",
    "OverlapLookupError",
    "OverlapStateError",
    "OverlapUsageError",
    "OverlapVerificationError",
    "OverlapcfgError",
    "RankFailedError",
    "SameScheduleError",
    "UnsupportedGraphError",
    "UpstreamPassError",
    "closest",
    "closest_first",
    "did_you_mean",
    "join_path",
    "natural_key",
    "shorten",
    "show_value",
]


SHOWN_FAULTS = 20
"""Lines of an ``OverlapConfigError`` message before "... and N more" (all faults are on ``.faults``): one line
per fault, or per set of faults sharing a message, so the message fits on one screen."""
SHOWN_PATHS = 3
"""Paths a line names for faults that share a message, before "and N more"."""


SHOWN_CHARS = 80
"""Most characters of a user's value an error message repeats: a 1 MB string is named, not echoed."""
SHOWN_PATH_CHARS = 300
"""Most characters of a fault's path (a path is made of the user's keys, and a key can be a megabyte)."""
SHOWN_MESSAGE_CHARS = 4000
"""Most characters of one fault's message; longer ones are cut (the cap is a backstop, see ``Fault``)."""


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was: ``'aaaa…' (1,048,576 characters)``."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def show_value(value: object) -> str:
    """A user's value in an error message: ``repr``, shortened (``shorten``); a huge integer by its size (its
    ``repr`` alone can be megabytes, and Python refuses to print one of more than 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}… ({len(value):,} characters)"
    return shorten(repr(value))


@dataclass(frozen=True, slots=True)
class Fault:
    """One thing wrong with a config: where (dotted config path) and what.

    Both are capped (``SHOWN_PATH_CHARS``, ``SHOWN_MESSAGE_CHARS``): where a message names a user's value it is
    shortened at the source (``show_value``), and the cap is the backstop that keeps a 1 MB key or value out of
    a message whatever path it took.
    """

    path: str
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", shorten(self.path, SHOWN_PATH_CHARS))
        object.__setattr__(self, "message", shorten(self.message, SHOWN_MESSAGE_CHARS))

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def join_path(root: str, loc: Sequence[str | int]) -> str:
    """A fault's dotted path: ``root`` then ``loc`` as the user wrote it (``overlap.plan.buckets[1].per``).

    Parts in angle brackets are a union's tags (``<mapping>``, see ``overlapcfg.config.plan.BucketEntry``), not
    keys the user wrote, and are dropped.
    """
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("<"):
            continue
        else:
            out = f"{out}.{part}" if out else part
    return out


class OverlapcfgError(Exception):
    """Base of every error overlapcfg raises for a user to see (the family is in the module docstring)."""


class OverlapConfigError(OverlapcfgError, ValueError):
    """A configuration (or a plan resolved against a model), a setting or an argument value is invalid. Nothing has
    been applied.

    ``str(err)`` lists every fault, one line each: ``overlap.policy.forward_prefetch: expected an integer >= 0,
    got 'abc'``.
    """

    def __init__(self, faults: Sequence[Fault] | str, *, header: str | None = None) -> None:
        if isinstance(faults, str):
            faults = [Fault("", faults)]
        self.faults: tuple[Fault, ...] = tuple(faults)
        self.header = header
        super().__init__(self._render())

    @classmethod
    def single(cls, path: str, message: str) -> OverlapConfigError:
        return cls([Fault(path, message)])

    def _render(self) -> str:
        # Every fault stays on ``.faults``; the message groups faults that share a message (39 parameters "not
        # divisible by world_size=3" are three lines, not 39) and shows the first SHOWN_FAULTS lines.
        grouped = _group_lines(self.faults)
        lines = [line for line, _ in grouped[:SHOWN_FAULTS]]
        if len(grouped) > SHOWN_FAULTS:
            lines.append(f"... and {sum(n for _, n in grouped[SHOWN_FAULTS:])} more")
        if self.header:
            noun = "fault" if len(self.faults) == 1 else "faults"
            return f"{self.header} ({len(self.faults)} {noun}):\n  " + "\n  ".join(lines)
        return "\n".join(lines)


def _group_lines(faults: Sequence[Fault]) -> list[tuple[str, int]]:
    """One line per message, with how many faults it stands for: ``a, b, c and 26 more: <message>``, or
    ``<message> (3 times)`` where the faults have no path. Messages keep their first-seen order."""
    groups: dict[str, list[str]] = {}
    for f in faults:
        groups.setdefault(f.message, []).append(f.path)
    lines = []
    for message, paths in groups.items():
        named = list(dict.fromkeys(p for p in paths if p))
        if not named:
            lines.append((message if len(paths) == 1 else f"{message} ({len(paths)} times)", len(paths)))
            continue
        shown, rest = ", ".join(named[:SHOWN_PATHS]), len(named) - SHOWN_PATHS
        lines.append((f"{shown} and {rest} more: {message}" if rest > 0 else f"{shown}: {message}", len(paths)))
    return lines


class OverlapUsageError(OverlapcfgError, TypeError):
    """An API called wrongly: a wrong type, a missing or contradictory argument; the message says what to pass."""


class OverlapStateError(OverlapcfgError, RuntimeError):
    """Called where it cannot work (no process group, nothing compiled yet, a model already sharded, a name
    already registered); the message says what to do first."""


class OverlapLookupError(OverlapcfgError, KeyError):
    """No bucket, graph, row or depth of that name; the message lists those there are (closest first)."""


class AttributionError(OverlapcfgError, RuntimeError):
    """Two pieces of evidence name different owners for one collective, or a collective names a parameter that the
    model does not have. The message names the node and the candidates; nothing has been changed."""


class RankFailedError(OverlapcfgError, RuntimeError):
    """A rank raised (message holds its traceback), or the run timed out."""


class SameScheduleError(OverlapcfgError, RuntimeError):
    """The ranks of a process group would issue different collectives (a divergence that would otherwise hang the
    job until the backend's timeout), or a rank did not reach the check in time. Raised on every rank that reached
    the check, with the same message (``overlapcfg.graph.same_schedule``). ``ranks``: the ranks that differ from
    the group's first rank, or that did not arrive; ``collective``: the 0-based position of the first differing
    collective (None for a rank that did not arrive, or for graphs that differ as a whole)."""

    def __init__(self, message: str, *, ranks: Sequence[int] = (), collective: int | None = None) -> None:
        super().__init__(message)
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.collective = collective

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled whole (a rank's error crossing processes), not re-built from ``args`` alone.
        return (_same_schedule_error, (str(self), self.ranks, self.collective))


def _same_schedule_error(message: str, ranks: tuple[int, ...], collective: int | None) -> SameScheduleError:
    return SameScheduleError(message, ranks=ranks, collective=collective)


class OverlapVerificationError(OverlapcfgError, RuntimeError):
    """A transformed graph violates an invariant; the message names the offending nodes."""

    def __init__(self, problems: Sequence[str], *, pass_name: str = "overlapcfg") -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        self.pass_name = pass_name
        shown = "\n  ".join(self.problems[:20])
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        super().__init__(f"{pass_name}: graph verification failed:\n  {shown}{more}")


_NUM = re.compile(r"([0-9]+)")


def natural_key(text: str) -> tuple[object, ...]:
    """Sort key putting ``layers.2`` before ``layers.10``.

    Only ASCII digit runs are numbers: ``'²'.isdigit()`` is true but ``int('²')`` fails, so the split's odd
    positions (the captured runs) are converted and the text between them never is.
    """
    return tuple(int(p) if i % 2 else p for i, p in enumerate(_NUM.split(text)))


_LONGEST_TYPO = 1000
"""Names longer than this are compared with nothing: no valid name is a typo away, and difflib's work grows with
the length (a megabyte-long key would take seconds to be told it is unknown)."""


def _ranked(name: str, candidates: Iterable[str]) -> list[tuple[bool, float, str]]:
    """``(contains, similarity, candidate)`` for each candidate, closest first: the one order of every "did you
    mean" and every "options (closest first)" list (the command line, Python and the Hydra routes all show it).

    A candidate holding ``name`` (case aside, ``name`` of 3 characters or more) comes first: ``h100`` means
    ``h100_nvlink`` more surely than ``a100_ib``, though difflib rates the shorter name a little closer. Then
    difflib's similarity ratio (as ``difflib.get_close_matches`` computes it), then natural order
    (``layers.2`` before ``layers.10``), so ties never depend on how the candidates were listed.
    """
    pool = sorted(dict.fromkeys(candidates), key=natural_key)
    if len(name) > _LONGEST_TYPO:
        return [(False, 0.0, c) for c in pool]
    low = name.lower()
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(name)
    ranked = []
    for candidate in pool:
        matcher.set_seq1(candidate)
        ranked.append((len(name) >= 3 and low in candidate.lower(), matcher.ratio(), candidate))
    order = {c: i for i, c in enumerate(pool)}
    return sorted(ranked, key=lambda r: (not r[0], -r[1], order[r[2]]))


def closest(name: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.5) -> list[str]:
    """The candidates near ``name`` (holding it, or difflib ratio >= ``cutoff``), closest first (``_ranked``)."""
    return [c for contains, ratio, c in _ranked(name, candidates) if contains or ratio >= cutoff][:n]


def closest_first(name: str, candidates: Iterable[str]) -> list[str]:
    """Every candidate, closest to ``name`` first (``_ranked``): how a list of valid options is shown after a typo."""
    return [c for _, _, c in _ranked(name, candidates)]


def did_you_mean(name: str, candidates: Iterable[str], n: int = 3) -> str:
    """`` (did you mean 'a', 'b'?)`` or an empty string."""
    hits = closest(name, candidates, n=n)
    if not hits:
        return ""
    return " (did you mean " + ", ".join(repr(h) for h in hits) + "?)"


class UnsupportedGraphError(OverlapcfgError, RuntimeError):
    """A graph the pass cannot handle correctly (already bucketed, or no FSDP collective under ``strict``); it is
    returned untouched, never half-rewritten."""


class UpstreamPassError(OverlapcfgError, RuntimeError):
    """torch's own pass (``schedule_overlap_bucketing`` for ``auto``, ``manual_overlap_bucketing`` for
    ``torch_manual``) raised on this graph: a bug or a limit of that torch release, not of the config. The graph is
    returned as it was; torch's error is the ``__cause__``. Its own class so that callers that try torch's pass as
    one option among others (the tuner's competitors) can leave it out and say why, and let every other error
    through."""
