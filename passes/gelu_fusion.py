"""Fuse the tanh-approximated GELU (as torch.onnx's dynamo exporter writes it) into com.microsoft.FastGelu.

Why: SigLIP's MLP uses gelu(approximate="tanh"), which the exporter spells as eight
elementwise nodes over the [B, S, 4304] activations (Pow, Mul, Add, Mul, Tanh, Add, Mul, Mul),
each one a pass over memory. ONNX Runtime's own FastGelu fusion does not take this spelling,
and its profile of siglip-so400m-384 showed those nodes at 8 % of the dense tower
(tools/bench_tower.py --op-profile: Mul 73, Add 55, Pow 32, Tanh 15 ms of 2683). FastGelu
computes the same formula in one pass, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

The rule matches by structure and checks each constant (the cube, 0.044715, √(2/π) to float32
precision, 1 and 0.5): the erf GELU (CLIP's quick_gelu and ViT's exact GELU are other nodes)
and any other coefficient are left alone, and `check` says which constant differs.
"""

from __future__ import annotations

import math

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from vlmprune.passes.attention_fusion import MS_DOMAIN
from vlmprune.passes.graph.dataflow import const_scalar

FUSED_GELU = f"{MS_DOMAIN}.FastGelu"
CONSTANTS = {"cube": 3.0, "coefficient": 0.044715, "sqrt(2/pi)": math.sqrt(2.0 / math.pi), "one": 1.0, "half": 0.5}


class FastGeluFusion(RewriteRuleClassBase):
    """x · (0.5 · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))) -> FastGelu(x)."""

    def pattern(self, op, x, cube, coefficient, root, one, half):
        inner = op.Add(x, op.Mul(op.Pow(x, cube), coefficient))
        return op.Mul(x, op.Mul(half, op.Add(op.Tanh(op.Mul(root, inner)), one)))

    def check(self, context, x, cube, coefficient, root, one, half, **_) -> MatchResult:
        result = MatchResult()
        for value, name in ((cube, "cube"), (coefficient, "coefficient"), (root, "sqrt(2/pi)"), (one, "one"),
                            (half, "half")):
            got = const_scalar(value)
            if got is None:
                return result.fail(f"the {name} is not a constant scalar")
            if not math.isclose(got, CONSTANTS[name], rel_tol=1e-6):
                return result.fail(f"the {name} is {got}, not {CONSTANTS[name]:.7g} (another activation)")
        if x.dtype is not None and x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            return result.fail(f"x is {x.dtype}, FastGelu takes float or float16")
        return result

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain=MS_DOMAIN)


def gelu_rules() -> list:
    """The rule with its commutative spellings (the exporter writes the constant on either side)."""
    return FastGeluFusion.rule().commute()


def count_fused(model: ir.Model) -> int:
    return sum(1 for n in model.graph.all_nodes() if n.domain == MS_DOMAIN and n.op_type == "FastGelu")
