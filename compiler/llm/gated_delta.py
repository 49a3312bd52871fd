"""A gated delta-net linear-attention layer's operator (Qwen3.5's Qwen3_5GatedDeltaNet), spelled out for the exported
graphs.

Why a module of its own: the layer is not attention and keeps two states of other kinds, so its math and what its
states are stay here, apart from compiler.llm.torch_exporter's attention (as compiler.llm.short_conv is LFM2's); the
exporter asks lm_source which layers are linear attention (recurrent_layers) and calls these two functions.

The operator (transformers' modeling_qwen3_5, on the layer's own modules): in_proj_qkv gives each row's queries, keys
and values packed, which go through a depthwise causal conv1d of kernel L (linear_conv_kernel_dim, no bias) and the
layer's activation (SiLU); in_proj_z a gate z, in_proj_b beta = sigmoid(b), in_proj_a the decay
g = -exp(A_log) * softplus(a + dt_bias). Queries and keys are L2-normed per head, the queries scaled by dk^-0.5 (key
heads repeated for the value heads where fewer), and the gated delta rule runs over the rows on a recurrent state
S [batch, value heads, dk, dv]: S = S * exp(g_t); S = S + k_t (beta_t (v_t - k_t S)); o_t = q_t S. The outputs go
through the layer's gated RMSNorm (norm(o) * silu(z)) and out_proj.

Its two states, as transformers' cache keeps them (LinearAttentionLayer): the convolution's last L inputs
[batch, 2 dk Hk + dv Hv, L] (zeros before the first row: what a decode step's convolution reads) and the recurrent
state after the last row [batch, Hv, dk, dv].

The prefill's recurrence over a prompt of any length is torch's scan (torch._higher_order_ops.scan), which torch.onnx
lowers to one ONNX Scan over the rows: the recurrence itself, token by token, exactly as transformers' recurrent form
writes it, so the prefill's outputs and state are the model's to float rounding at any prompt length (transformers'
own prefill, the chunked form, is the same sums in another order). A decode step is one step of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan


MODULE = "linear_attn"  # the decoder layer's attribute holding the operator (Qwen3_5GatedDeltaNet)
STATES = ("conv", "recurrent")  # the states one layer keeps, as the graphs name them (present.{i}.conv, .recurrent)


def state_shapes(attn) -> list[list[int]]:
    """Each state's shape past the batch: the convolution's last L inputs [channels, L], the rule's state
    [value heads, dk, dv]."""
    return [[attn.conv_dim, attn.conv1d.kernel_size[0]], [attn.num_v_heads, attn.head_k_dim, attn.head_v_dim]]


def _activation(attn):
    from transformers.activations import ACT2FN

    return ACT2FN[attn.activation]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm (FLA's): x / sqrt(sum x² + 1e-6) over the last axis."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _gates(attn, x: torch.Tensor):
    """(z [batch, T, Hv, dv], beta [batch, T, Hv], g [batch, T, Hv]) of rows x [batch, T, hidden]."""
    b, t, _ = x.shape
    z = attn.in_proj_z(x).reshape(b, t, -1, attn.head_v_dim)
    beta = attn.in_proj_b(x).sigmoid()
    g = -attn.A_log.float().exp() * F.softplus(attn.in_proj_a(x).float() + attn.dt_bias)
    return z, beta, g


def _heads(attn, mixed: torch.Tensor):
    """(q, k, v) [batch, T, Hv, d] of the convolved rows mixed [batch, T, channels]: split, L2-normed q and k (q scaled
    by dk^-0.5), the key heads repeated for the value heads (grouped value attention)."""
    b, t, _ = mixed.shape
    q, k, v = torch.split(mixed, [attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    q = q.reshape(b, t, -1, attn.head_k_dim)
    k = k.reshape(b, t, -1, attn.head_k_dim)
    v = v.reshape(b, t, -1, attn.head_v_dim)
    if attn.num_v_heads != attn.num_k_heads:
        groups = attn.num_v_heads // attn.num_k_heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * (q.shape[-1] ** -0.5), k, v.float()


def _rule(state, q, k, v, g, beta):
    """One step of the gated delta rule: (new state [batch, Hv, dk, dv], output [batch, Hv, dv]) of one row's
    q, k [batch, Hv, dk], v [batch, Hv, dv], g, beta [batch, Hv] (transformers' torch_recurrent_gated_delta_rule)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - remembered) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return state, (state * q.unsqueeze(-1)).sum(dim=-2)


def _out(attn, core: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
    """out_proj of the gated RMSNorm of the outputs core [batch, T, Hv, dv] with z."""
    b, t = core.shape[:2]
    return attn.out_proj(attn.norm(core.to(dtype), z).reshape(b, t, -1))


def prefill(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [batch, T, hidden], conv state [batch, channels, L], recurrent state [batch, Hv, dk, dv]) of the
    prompt's rows x [batch, T, hidden], from zero states: the module's own Conv1d (padded L - 1 on both sides, the
    first T outputs: causal), the rule scanned over the rows."""
    b, t, _ = x.shape
    mixed = attn.in_proj_qkv(x).transpose(1, 2)  # [batch, channels, T]
    kernel = attn.conv1d.kernel_size[0]
    conv_state = F.pad(mixed, (kernel, 0))[..., -kernel:]
    mixed = _activation(attn)(attn.conv1d(mixed)[..., :t]).transpose(1, 2)
    z, beta, g = _gates(attn, x)
    q, k, v = _heads(attn, mixed)
    start = torch.zeros(b, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim, dtype=v.dtype)

    def step(state, row):
        return _rule(state, *row)

    # the rows along the scanned axis: [T, batch, Hv, ...]
    state, core = scan(step, start, tuple(y.transpose(0, 1) for y in (q, k, v, g.float(), beta.float())))
    return _out(attn, core.transpose(0, 1), z, x.dtype), conv_state, state


def step(attn, x: torch.Tensor, conv_state: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [batch, 1, hidden], new conv state, new recurrent state) of one row x [batch, 1, hidden] on the states:
    the convolution over the last L inputs with this row's (which are the new conv state), one step of the rule."""
    mixed = attn.in_proj_qkv(x).transpose(1, 2)  # [batch, channels, 1]
    kernel = attn.conv1d.kernel_size[0]
    window = torch.cat([conv_state, mixed], dim=-1)[..., -kernel:]
    conv = F.conv1d(window, attn.conv1d.weight, attn.conv1d.bias, groups=window.shape[1])
    z, beta, g = _gates(attn, x)
    q, k, v = _heads(attn, _activation(attn)(conv).transpose(1, 2))
    state, core = _rule(state.float(), q[:, 0], k[:, 0], v[:, 0], g[:, 0].float(), beta[:, 0].float())
    return _out(attn, core[:, None], z, x.dtype), window, state
