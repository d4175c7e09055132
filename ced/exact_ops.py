"""Faster forms of steps of the attention's reference read (`ced.attention._read_reference`,
the read bf16 training runs) that compute the same bits as the plain torch calls they stand
for, outputs and gradients: how its matmuls take their operands (`matmul_operand`), and the
masking of hidden keys' logits (`masked_fill_hidden`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# The integer type of each float type's width, to operate on the floats' bits.
_SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float32: torch.int32, torch.float64: torch.int64}


def matmul_operand(q: Tensor) -> Callable[[Tensor], Tensor]:
    """How the reference read hands its plain matmuls their operands, for queries q
    [B, H, C, Dh]: a function of an operand tensor [..., M, N] to the tensor to pass.

    On CPU in bfloat16 (bf16 tensors, or bf16 autocast, which casts every matmul operand) the
    batched matmul is oneDNN's, and it copies each operand that is neither contiguous nor a
    contiguous matrix transposed: in the forward, and again in each of the backward's two
    products. A query block, its window K/V rows and its slices of the joint probabilities are
    all such views, so each is laid out once, contiguous and in the dtype the matmul computes
    in (the cast autocast would make): the same values read by the same kernel, and the
    backward then reads the saved operands transposed in place, which gives the same products
    bit for bit (checked at the studies' bf16 shapes, outputs and gradients). In any other
    dtype, or on another device, operands pass as they are."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    if q.device.type != "cpu" or dtype != torch.bfloat16:
        return lambda x: x
    return lambda x: x.to(torch.bfloat16).contiguous()


def hidden_bits(hidden: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """What `masked_fill_hidden` needs of a mask: hidden, a BoolTensor of any shape (True where
    a query may not read the key) -> (keep, fill), integer tensors of hidden's shape and of
    dtype's width: keep has every bit set where hidden is False and none where it is True;
    fill holds the bits of -inf in dtype where hidden is True, else 0. Built once per mask and
    dtype (the caller memoizes it with the mask, `ced.attention.shared`)."""
    as_int = _SAME_WIDTH_INT[dtype]
    minus_inf = int(torch.tensor(-torch.inf, dtype=dtype).view(as_int))
    # conversions and products rather than masked_fill: see _MaskedFill for why
    return (~hidden).to(as_int).neg_(), hidden.to(as_int).mul_(minus_inf)


class _MaskedFill(torch.autograd.Function):
    """scores.masked_fill(hidden, -inf) as (bits & keep) | fill, and its gradient
    grad.masked_fill(hidden, 0) as grad's bits & keep: the same bits for every input (NaN and
    infinities included), since each output element is the input element or the fill value,
    bit for bit. Why: torch's CPU masked_fill kernel is not vectorised and took about 2 ns an
    element, ten times an add (about 80 ms of a bf16 training step at the encoder_w study's
    E8_L8 shape), where the integer and/or run at the speed of an add."""

    @staticmethod
    def forward(ctx, scores: Tensor, keep: Tensor, fill: Tensor) -> Tensor:
        ctx.save_for_backward(keep)
        return (scores.view(keep.dtype) & keep).bitwise_or_(fill).view(scores.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return (grad.view(keep.dtype) & keep).view(grad.dtype), None, None


def masked_fill_hidden(scores: Tensor, bits: tuple[Tensor, Tensor]) -> Tensor:
    """scores.masked_fill(hidden, -inf), bit for bit with its gradient: scores [B, H, C, S],
    bits = hidden_bits(hidden, scores.dtype) for a hidden broadcastable to scores
    ([B|1, 1, C, S]) -> [B, H, C, S]."""
    return _MaskedFill.apply(scores, *bits)

