"""A benchmark mode's name, parsed in one place.

    MODE            a deployment of its own: colocated, pull, push, push-layerwise, auto, auto+NAME
                    (auto with other proxy flags, bench/suite.py's auto_variants)
    DEPLOYMENT@R    route R forced on DEPLOYMENT's processes (X-KVPush-KV-Mode): auto@push, ...
    M#N             a twin of mode M (N >= 2): the same endpoint, the same route and, in the regime map,
                    the same prompts as M; run as one more mode so that M#N against M is an A/A check of
                    the intervals the map puts on two modes' ratios
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"(?P<deployment>[A-Za-z0-9_+-]+)(?:@(?P<route>[A-Za-z0-9_-]+))?(?:#(?P<twin>[2-9]|[1-9][0-9]+))?")


@dataclass(frozen=True)
class ModeName:
    text: str  # as given: "auto@push#2"
    deployment: str  # the mode whose processes serve it: "auto"
    route: str | None  # a forced route: "push"; None where the deployment chooses
    twin: int  # N of a twin (M#N), else 0

    @property
    def base(self) -> str:
        """The mode a twin repeats ("auto@push" of "auto@push#2"); the name itself for any other."""
        return self.text.split("#", 1)[0]

    @property
    def own_deployment(self) -> bool:
        """Whether the mode starts processes of its own (not a forced route, not a twin)."""
        return self.route is None and not self.twin


def parse(mode: str) -> ModeName:
    """Parse a mode name. Raises ValueError on one that is none of the forms above."""
    m = _NAME.fullmatch(mode)
    if m is None:
        raise ValueError(f"mode {mode!r}: expected MODE, DEPLOYMENT@ROUTE, or either followed by #N (N >= 2)")
    return ModeName(mode, m["deployment"], m["route"], int(m["twin"] or 0))


def base(mode: str) -> str:
    """The mode a twin repeats, else the mode itself."""
    return parse(mode).base


def is_twin(mode: str) -> bool:
    return parse(mode).twin > 0


def variant_name(mode: str) -> str | None:
    """NAME of the auto variant whose deployment serves the mode (auto+NAME, also forced or twinned), else None."""
    deployment = parse(mode).deployment
    return deployment.split("+", 1)[1] if deployment.startswith("auto+") else None


def is_auto(mode: str) -> bool:
    """auto or a variant of it (auto+NAME), twinned or not: a deployment whose proxy chooses the route."""
    name = parse(mode)
    return name.route is None and (name.deployment == "auto" or variant_name(mode) is not None)
