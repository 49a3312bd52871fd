"""vlmprune.targets: one adapter per deployment target.

The table below is the whole list: adapters are named explicitly, never discovered.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.errors import InputError
from vlmprune.targets.base import Target
from vlmprune.targets.openvino import OpenVinoTarget
from vlmprune.targets.ort import OrtTarget
from vlmprune.targets.qnn import QnnTarget
from vlmprune.targets.rk3588 import Rk3588Target
from vlmprune.targets.tensorrt import OrinTarget, XavierTarget

TARGETS: dict[str, type[Target]] = {"ort": OrtTarget, "orin": OrinTarget, "xavier": XavierTarget,
                                  "rk3588": Rk3588Target, "qnn": QnnTarget,
                                  "openvino": OpenVinoTarget}
DEFAULT_TARGET = "ort"  # `vlmprune compile` without --target
HOST_TARGET = "ort"  # eval --dataset's default: the host runtime, whose runner runs everywhere
# Named in the design, not built yet: listed so that users get a precise answer.
PLANNED: dict[str, str] = {}


def get_target(name: str) -> Target:
    if name in TARGETS:
        return TARGETS[name]()
    if name in PLANNED:
        raise InputError(f"target {name!r} is planned but not implemented in this version; available: {', '.join(TARGETS)}")
    raise InputError(f"unknown target {name!r}; choose one of: {', '.join([*TARGETS, *PLANNED])}")


def require_engine(name: str, bundle_dir: Path) -> str:
    """For `check --engine`: the engine stage of a bundle of target `name` (Target.require_engine: one line unless it
    can run here), or one line naming the targets that have one where this one builds no engine on the device."""
    target = get_target(name)
    stage = target.require_engine(bundle_dir)
    if not stage:
        takes = [other for other, cls in TARGETS.items() if cls.require_engine is not Target.require_engine]
        raise InputError(f"{bundle_dir} targets {target.name}, which has no engine stage (--engine: "
                         f"{', '.join(takes)})")
    return stage
