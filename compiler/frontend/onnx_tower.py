"""Family `onnx`: a vision tower exported to .onnx elsewhere.

There is no torch model: the passes find its blocks by structure, and parity's reference
comes from the original graph itself (compiler.parity.reference). Loading reads the graph
without its weights and checks what would otherwise fail later with a traceback: a
readable protobuf, pixel input [B, C, H, W] with static H and W, and every external-data
file present and long enough.
"""

from __future__ import annotations

from pathlib import Path

from vlmprune.compiler.errors import InputError
from vlmprune.compiler.frontend.family import FEATURE_LAYER, PATCH_TOKENS, DenseRequest, Family
from vlmprune.compiler.frontend.source import Source, sha256_files

FAMILY = "onnx"


def load_onnx_tower(path: Path) -> Source:
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:
        raise InputError(f"{path}: not a readable ONNX model") from None
    if not proto.graph.input:
        raise InputError(f"{path}: the ONNX graph has no inputs")
    external = check_external_data(path, proto)
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    image_size = dims[2] if len(dims) == 4 and dims[2] > 0 else 0
    if image_size == 0:
        raise InputError(f"{path}: the first input should be pixels [B, C, H, W] with static H and W")
    return Source(str(path.resolve()), "onnx", FAMILY, sha256_files([path, *external]), image_size, None, None,
                  onnx_path=path, details={"static_batch": dims[0] if dims[0] > 0 else None})


def check_external_data(path: Path, proto) -> list[Path]:
    """The external-data files the model names, each checked to exist and to hold the bytes it points at."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    files: dict[Path, int] = {}
    for tensor in proto.graph.initializer:
        if not uses_external_data(tensor):
            continue
        info = ExternalDataInfo(tensor)
        location = (path.parent / info.location).resolve()
        if path.parent.resolve() not in location.parents:
            raise InputError(f"{path}: initializer {tensor.name} points outside the model's folder ({info.location})")
        end = (info.offset or 0) + (info.length or 0)
        files[location] = max(files.get(location, 0), end)
    for location, end in files.items():
        if not location.is_file():
            raise InputError(f"{path}: its external data file {location.name} is missing (expected beside the model)")
        if location.stat().st_size < end:
            raise InputError(f"{path}: external data file {location.name} is truncated "
                             f"({location.stat().st_size} bytes, the model reads up to {end})")
    return sorted(files)


class OnnxFamily(Family):
    """An .onnx tower: no torch model, so no adapter; the original graph is its own reference."""

    id = FAMILY
    has = {PATCH_TOKENS: ".onnx towers", FEATURE_LAYER: ".onnx towers"}
    torch_reference = False
    identifies_model = False

    def fix(self, source: Source, options: dict, *, prune: bool, batch: int | None, cls: str | None) -> None:
        if batch is not None:
            raise InputError("--batch cannot change an .onnx source; re-export it with the batch you need")

    def fit_params(self, source: Source, config, site_spec: type):
        return config  # an .onnx tower is one image: no parameter is relative to its site before the insertion

    def check_method(self, source: Source, config, site_spec: type) -> None:
        """What needs a torch tower is refused now; the insertion checks its site in the graph."""
        config.method.check_onnx_source(config.params)

    def dense_model(self, source: Source, request: DenseRequest):
        """The graph itself, given the bundle's output contract (passes.onnx_tower, handed down as onnx_contract).

        --cls drop|keep, else dropped (LLaVA's default; bare towers follow it).
        """
        import onnx_ir as ir

        path = source.onnx_path
        request.step(f"load {path.name} (ONNX, opset {_opset_of(path)})")
        try:
            model = ir.load(path)
        except Exception as exc:  # external data that ONNX cannot read, after the checks at load
            raise InputError(f"{path}: cannot be loaded ({str(exc).splitlines()[0]})") from None
        contract = request.onnx_contract(drop_cls=request.cls != "keep")
        contract(model)
        source.patch_size = source.patch_size or contract.patch_size  # pictures need it
        return model


def _opset_of(path: Path) -> int:
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
