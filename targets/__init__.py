"""vlmprune.targets: one adapter per deployment target.

The table below is the whole list: adapters are named explicitly, never discovered.
"""

from __future__ import annotations

from vlmprune.compiler.errors import InputError
from vlmprune.targets.base import Target
from vlmprune.targets.ort import OrtTarget

TARGETS: dict[str, type[Target]] = {"ort": OrtTarget}
# Named in the design, not built yet: listed so that users get a precise answer.
PLANNED = {
    "orin": "Jetson Orin: TensorRT 10.3, CUDA 12.6, sm_87, IPluginV3",
    "xavier": "Jetson Xavier: TensorRT 8.5.2, CUDA 11.4, sm_72, IPluginV2DynamicExt",
    "rk3588": "Rockchip RK3588: rknn-toolkit2 2.5.0 (.rknn)",
    "qnn": "Snapdragon HTP: ONNX Runtime QNN EP (QDQ + EPContext)",
}


def get_target(name: str) -> Target:
    if name in TARGETS:
        return TARGETS[name]()
    if name in PLANNED:
        raise InputError(f"target {name!r} is planned but not implemented in this version; available: {', '.join(TARGETS)}")
    raise InputError(f"unknown target {name!r}; choose one of: {', '.join([*TARGETS, *PLANNED])}")
