"""Reference models of the paper's experiments (Appendix A, "Model Details").

Three families, all built so that their behaviour *at initialisation* is invariant to width and
depth (Kaiming init plus a ``1/sqrt(L)`` residual factor); FLeRM is what makes them invariant
*during training*.

- :class:`ResMLP`: input linear -> ``depth`` residual blocks of one linear layer each -> readout.
- :class:`ResConvNet`: input convolution -> ``depth`` residual blocks of one convolution each
  (optionally BatchNorm-ed) -> global average pool -> readout; 1-D or 2-D, width = channels.
- :class:`Transformer`: decoder-only, QK layer norm, non-affine layer norms, three norm
  placements (PostNorm, PreNorm, PreNormPostMod).

Parameter names are stable and readable, so that per-tensor FSLRs can be grouped by role and
depth policies can find block indices with the regex :data:`BLOCK_RE`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fslr_func.probe.names import BLOCK_PATTERN, block_index, compile_block_pattern

__all__ = [
    "BLOCK_RE",
    "ConvBlock",
    "ResConvNet",
    "ResMLP",
    "Transformer",
    "block_index",
    "kaiming_normal_",
]

BLOCK_RE = compile_block_pattern(BLOCK_PATTERN)
"""Finds the residual-block index in a parameter name, e.g. ``blocks.3.linear.weight`` -> 3."""

NormType = Literal["prenorm", "postnorm", "prenormpostmod"]


@torch.no_grad()
def kaiming_normal_(weight: Tensor, gain: float = 1.0, scale: float = 1.0) -> Tensor:
    """Kaiming/He init in place: i.i.d. Gaussian with variance ``gain / fan_in``, times ``scale``.

    ``gain`` is the paper's activation-specific factor on the *variance*: 2 for a layer fed by a
    ReLU, 1 for a layer fed by anything else. ``scale`` multiplies the standard deviation (the
    ``1/sqrt(L)`` depth factor and the init-scale axis).

    Args:
        weight: a ``(fan_out, fan_in)`` weight matrix.
        gain: variance gain.
        scale: extra factor on the standard deviation.

    Returns:
        ``weight``, modified in place.

    Examples:
        >>> w = kaiming_normal_(torch.empty(4000, 50), gain=2.0)
        >>> abs(w.var().item() * 50 / 2.0 - 1.0) < 0.05
        True
    """
    fan_in = weight.shape[1]
    return weight.normal_(0.0, scale * math.sqrt(gain / fan_in))


class _Linear(nn.Linear):
    """``nn.Linear`` with Kaiming-normal weight and zero bias."""

    def __init__(
        self, fan_in: int, fan_out: int, gain: float = 1.0, scale: float = 1.0, bias: bool = True
    ) -> None:
        super().__init__(fan_in, fan_out, bias=bias)
        kaiming_normal_(self.weight, gain, scale)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class ResBlock(nn.Module):
    """One ResMLP residual block: ``x + linear(relu(x))`` (the linear layer is ReLU-fed)."""

    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        self.linear = _Linear(width, width, gain=2.0, scale=scale)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.linear(F.relu(x))


class ResMLP(nn.Module):
    """Residual MLP of the paper (Appendix A.1): no norms, ReLU, Kaiming init, zero biases.

    ``h = input(x)``; ``depth`` times ``h = h + W_l relu(h) + b_l``; ``out = readout(h)``.
    Each block weight has variance ``2 / width`` times ``1/depth`` (the ``1/sqrt(L)`` factor
    folded into the weights at init, so it does not act in the forward pass during training) and
    times ``init_scale**2``. The input and readout layers are not ReLU-fed: gain 1.

    Args:
        in_features: input dimension.
        num_classes: number of outputs.
        width: hidden dimension (the paper's base model uses 128).
        depth: number of residual blocks (base model: 4).
        init_scale: multiplies the standard deviation of the hidden (block) weights at init.

    Parameter names: ``input.weight``, ``blocks.{i}.linear.weight``, ``readout.weight`` (and the
    matching ``.bias``).

    Examples:
        >>> model = ResMLP(40, 10, width=32, depth=2)
        >>> model(torch.randn(5, 40)).shape
        torch.Size([5, 10])
        >>> [n for n, _ in model.named_parameters()][:3]
        ['input.weight', 'input.bias', 'blocks.0.linear.weight']
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        width: int = 128,
        depth: int = 4,
        init_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.width = width
        self.depth = depth
        self.input = _Linear(in_features, width)
        self.blocks = nn.ModuleList(
            ResBlock(width, scale=init_scale / math.sqrt(depth)) for _ in range(depth)
        )
        self.readout = _Linear(width, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Residual stream after the last block (the readout's input)."""
        h = self.input(x.flatten(1))
        for block in self.blocks:
            h = block(h)
        return h

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(self.features(x))


def _conv(
    dims: int, fan_in: int, fan_out: int, kernel: int, gain: float, scale: float, stride: int = 1
) -> nn.Conv1d | nn.Conv2d:
    r"""A ``dims``-D convolution, "same" padding, Kaiming-normal weight over its true fan-in
    :math:`c_\text{in} k^{d}` (variance ``gain / fan_in`` times ``scale**2``), zero bias."""
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    conv = cls(fan_in, fan_out, kernel, stride=stride, padding=kernel // 2)
    with torch.no_grad():
        fan = fan_in * kernel**dims
        conv.weight.normal_(0.0, scale * math.sqrt(gain / fan))
        assert conv.bias is not None
        conv.bias.zero_()
    return conv


class ConvBlock(nn.Module):
    """One residual conv block: ``x + conv(relu(x))``, or ``x + conv(relu(bn(x)))`` with
    ``batchnorm`` (pre-activation, affine BatchNorm). The conv is ReLU-fed (gain 2)."""

    def __init__(self, dims: int, width: int, kernel: int, scale: float, batchnorm: bool) -> None:
        super().__init__()
        self.norm: nn.Module = (
            (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(width) if batchnorm else nn.Identity()
        )
        self.conv = _conv(dims, width, width, kernel, gain=2.0, scale=scale)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(F.relu(self.norm(x)))


class ResConvNet(nn.Module):
    r"""Residual convolutional net, width = channels, 1-D or 2-D, with or without BatchNorm.

    ``h = conv_in(x)`` (stride ``stride``); ``depth`` times ``h = h + conv_l(relu(bn_l(h)))``
    (``bn_l`` the identity without ``batchnorm``); ``out = readout(mean over positions of h)``.
    Every weight is Kaiming-normal over its fan-in :math:`c_\text{in} k^{d}` (a conv's fan-in
    counts its kernel, which is what muP's width multiplier reads: only the channel dims grow),
    block convolutions with variance ``2 / fan_in`` times ``1 / depth`` times ``init_scale**2``
    (the ResMLP's convention), biases zero. Inputs arrive flat, ``(N, prod(in_shape))``, as the
    built-in data sets store them, and are viewed as ``(N, *in_shape)``.

    Args:
        in_shape: ``(channels, length)`` (1-D) or ``(channels, height, width)`` (2-D).
        num_classes: number of outputs.
        width: channels of the residual stream.
        depth: number of residual blocks.
        init_scale: multiplies the standard deviation of the block weights at init.
        batchnorm: a BatchNorm (affine, batch statistics in training) before each block's ReLU.
        kernel: kernel size of every convolution (odd).
        stride: stride of the input convolution (2 halves the 1-D length, a cheaper net).

    Parameter names: ``input.weight``, ``blocks.{i}.conv.weight``, ``blocks.{i}.norm.weight``
    (with ``batchnorm``), ``readout.weight`` (and the ``.bias`` of each).

    Examples:
        >>> net = ResConvNet((1, 40), 10, width=8, depth=2, stride=2)
        >>> net(torch.randn(5, 40)).shape, net.blocks[0].conv.weight.shape
        (torch.Size([5, 10]), torch.Size([8, 8, 3]))
        >>> net2 = ResConvNet((1, 8, 8), 10, width=8, depth=2, batchnorm=True)
        >>> [n for n, _ in net2.named_parameters()][2:6]
        ['blocks.0.norm.weight', 'blocks.0.norm.bias', 'blocks.0.conv.weight', 'blocks.0.conv.bias']
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        num_classes: int,
        width: int = 32,
        depth: int = 4,
        init_scale: float = 1.0,
        batchnorm: bool = False,
        kernel: int = 3,
        stride: int = 1,
    ) -> None:
        super().__init__()
        if len(in_shape) not in (2, 3):
            raise ValueError(f"in_shape must be (C, L) or (C, H, W), got {in_shape}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if kernel % 2 != 1:
            raise ValueError(f"kernel must be odd, got {kernel}")
        dims = len(in_shape) - 1
        self.in_shape = tuple(in_shape)
        self.width = width
        self.depth = depth
        self.input = _conv(dims, in_shape[0], width, kernel, gain=1.0, scale=1.0, stride=stride)
        self.blocks = nn.ModuleList(
            ConvBlock(dims, width, kernel, init_scale / math.sqrt(depth), batchnorm)
            for _ in range(depth)
        )
        self.readout = _Linear(width, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """Residual stream after the last block, averaged over positions."""
        h = self.input(x.reshape(x.shape[0], *self.in_shape))
        for block in self.blocks:
            h = block(h)
        return h.flatten(2).mean(2)

    def forward(self, x: Tensor) -> Tensor:
        return self.readout(self.features(x))


def _layer_norm(dim: int, affine: bool) -> nn.LayerNorm:
    return nn.LayerNorm(dim, elementwise_affine=affine)


class Attention(nn.Module):
    """Causal multi-head self-attention with QK layer norm and separate q, k, v, o linears."""

    def __init__(self, d_model: int, n_heads: int, affine: bool, init_scale: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q = _Linear(d_model, d_model, scale=init_scale)
        self.k = _Linear(d_model, d_model, scale=init_scale)
        self.v = _Linear(d_model, d_model, scale=init_scale)
        self.o = _Linear(d_model, d_model, scale=init_scale)
        self.q_norm = _layer_norm(self.d_head, affine)
        self.k_norm = _layer_norm(self.d_head, affine)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        # (b, t, d) -> (b, heads, t, d_head); the QK norm acts over each head's features.
        q = self.q_norm(self.q(x).view(b, t, self.n_heads, self.d_head)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, self.n_heads, self.d_head)).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_heads, self.d_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """``down(relu(up(x)))``; ``down`` is ReLU-fed (gain 2)."""

    def __init__(self, d_model: int, d_ff: int, init_scale: float) -> None:
        super().__init__()
        self.up = _Linear(d_model, d_ff, scale=init_scale)
        self.down = _Linear(d_ff, d_model, gain=2.0, scale=init_scale)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(x)))


class DecoderBlock(nn.Module):
    """Self-attention + feed-forward with one of the paper's three norm placements.

    With ``a = 1/sqrt(L)``, ``L`` the number of blocks (Appendix A.2):

    - ``postnorm``:       ``x = Norm(x + a f(x))``
    - ``prenorm``:        ``x = x + a f(Norm(x))``
    - ``prenormpostmod``: ``x = x + a Norm(f(x))``

    applied to ``f = attn`` and then to ``f = ff``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        norm: NormType,
        affine: bool,
        init_scale: float,
        residual_scale: float,
    ) -> None:
        super().__init__()
        self.norm_type = norm
        self.residual_scale = residual_scale
        self.attn = Attention(d_model, n_heads, affine, init_scale)
        self.norm1 = _layer_norm(d_model, affine)
        self.ff = FeedForward(d_model, d_ff, init_scale)
        self.norm2 = _layer_norm(d_model, affine)

    def _residual(self, x: Tensor, f: nn.Module, norm: nn.Module) -> Tensor:
        a = self.residual_scale
        if self.norm_type == "postnorm":
            return norm(x + a * f(x))
        if self.norm_type == "prenorm":
            return x + a * f(norm(x))
        return x + a * norm(f(x))

    def forward(self, x: Tensor) -> Tensor:
        x = self._residual(x, self.attn, self.norm1)
        return self._residual(x, self.ff, self.norm2)


class Transformer(nn.Module):
    """Decoder-only transformer of the paper (Appendix A.2), for byte-level language modelling.

    Learned token and positional embeddings (``N(0, 1)`` init), ``depth`` decoder blocks with QK
    layer norm and a ``1/sqrt(depth)`` factor on every residual branch in the forward pass, a final
    layer norm, and a readout linear to the vocabulary. Layer norms have no affine parameters
    unless ``affine=True``. All weight matrices are Kaiming-initialised (gain 2 for the ReLU-fed
    ``ff.down``, 1 otherwise), biases zero; ``init_scale`` multiplies every block weight (q, k, v,
    o, up, down) but not the embeddings or the readout.

    ``width_mult`` scales ``d_model``, ``d_ff`` and ``n_heads`` together (the head dimension stays
    fixed), as in the paper's width experiments.

    Args:
        vocab_size: number of tokens (256 for bytes).
        d_model: residual-stream width at ``width_mult=1``.
        n_heads: attention heads at ``width_mult=1``.
        d_ff: feed-forward hidden width at ``width_mult=1``.
        depth: number of decoder blocks.
        seq_len: maximum sequence length (size of the positional embedding).
        norm: ``"postnorm"``, ``"prenorm"`` or ``"prenormpostmod"``.
        affine: give the layer norms learnable scale and shift.
        init_scale: multiplies the standard deviation of the block weights at init.
        width_mult: width multiplier.

    Parameter names: ``embed.weight``, ``pos.weight``, ``blocks.{i}.attn.{q,k,v,o}.weight``,
    ``blocks.{i}.ff.up.weight``, ``blocks.{i}.ff.down.weight``, ``readout.weight`` (plus biases).

    Examples:
        >>> model = Transformer(d_model=32, n_heads=2, d_ff=64, depth=2, seq_len=16)
        >>> model(torch.randint(0, 256, (3, 16))).shape
        torch.Size([3, 16, 256])
        >>> Transformer(d_model=32, n_heads=2, d_ff=64, width_mult=2).blocks[0].attn.n_heads
        4
    """

    def __init__(
        self,
        vocab_size: int = 256,
        d_model: int = 128,
        n_heads: int = 2,
        d_ff: int = 512,
        depth: int = 2,
        seq_len: int = 128,
        norm: NormType = "prenorm",
        affine: bool = False,
        init_scale: float = 1.0,
        width_mult: int = 1,
    ) -> None:
        super().__init__()
        if norm not in ("prenorm", "postnorm", "prenormpostmod"):
            raise ValueError(f"unknown norm {norm!r}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        d_model, d_ff, n_heads = d_model * width_mult, d_ff * width_mult, n_heads * width_mult
        self.d_model = d_model
        self.depth = depth
        self.seq_len = seq_len
        self.norm_type: NormType = norm
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        nn.init.normal_(self.embed.weight)
        nn.init.normal_(self.pos.weight)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, n_heads, d_ff, norm, affine, init_scale, 1.0 / math.sqrt(depth))
            for _ in range(depth)
        )
        self.final_norm = _layer_norm(d_model, affine)
        self.readout = _Linear(d_model, vocab_size)

    def features(self, tokens: Tensor) -> Tensor:
        """The readout's input ``(batch, seq, d_model)``: the final norm of the residual stream."""
        t = tokens.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for integer ``tokens`` of shape ``(batch, seq)``."""
        return self.readout(self.features(tokens))
