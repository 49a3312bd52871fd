"""A gated short-convolution layer's operator (LFM2's Lfm2ShortConv), spelled out for the exported graphs.

Why a module of its own: the layer is not attention and keeps a state of another kind, so its math and what its state
is stay here, apart from compiler.llm.torch_exporter's attention; the exporter asks lm_source which layers are
convolutions (conv_layers) and calls these two functions, with what the module declares (MODULE, STATES,
state_shapes), as it does compiler.llm.gated_delta's.

The operator (transformers' modeling_lfm2, on the layer's own modules): in_proj splits each row into B, C and x; B*x
goes through a depthwise causal conv1d of kernel L (conv_L_cache); C times its output goes through out_proj. A decode
step needs the last L - 1 inputs of the convolution (B*x rows); the state is kept L wide, as transformers' cache
keeps it (Lfm2's conv_states: the last L inputs, zeros before the first row), so that the graphs' state is the
reference's own tensor and compares with it; its first column is not read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


MODULE = "conv"  # the decoder layer's attribute holding the operator (Lfm2ShortConv)
STATES = ("conv",)  # the states one layer keeps, as the graphs name them (present.{i}.conv)


def state_shapes(conv) -> list[list[int]]:
    """Each state's shape past the batch: the convolution's last L inputs [hidden, L]."""
    return [[conv.conv.in_channels, conv.conv.kernel_size[0]]]


def _gated_input(conv, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B*x [batch, hidden, T], C [batch, hidden, T]) of rows x [batch, T, hidden]."""
    b, c, h = conv.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)
    return b * h, c


def _out(conv, c: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return conv.out_proj((c * y).transpose(-1, -2))


def prefill(conv, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [batch, T, hidden], state [batch, hidden, L]) of the prompt's rows x [batch, T, hidden]: the module's own
    Conv1d (padded L - 1 on both sides, the first T outputs: causal), the state the last L inputs, zeros before the
    prompt where it is shorter than L."""
    gated, c = _gated_input(conv, x)
    length, kernel = gated.shape[-1], conv.conv.kernel_size[0]
    y = conv.conv(gated)[..., :length]
    state = F.pad(gated, (kernel, 0))[..., -kernel:]
    return _out(conv, c, y), state


def step(conv, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [batch, 1, hidden], new state [batch, hidden, L]) of one row x [batch, 1, hidden] on state: the new
    state is the last L inputs with this row's, and the convolution over them is this row's output."""
    gated, c = _gated_input(conv, x)
    kernel = conv.conv.kernel_size[0]
    window = torch.cat([state, gated], dim=-1)[..., -kernel:]
    y = F.conv1d(window, conv.conv.weight, conv.conv.bias, groups=window.shape[1])
    return _out(conv, c, y), window
