"""ced.exact_ops computes the same bits as the plain torch calls it stands for: the masking of
hidden logits, and the reference read (`ced.attention.joint_read` where the fused kernel does
not run, as in bf16 autocast training) with its operands laid out for oneDNN, outputs and
gradients compared as integers (so NaN payloads and the sign of zero count too)."""

from __future__ import annotations

import pytest
import torch

from ced.attention import KeySet, attention_kernel, joint_read
from ced.exact_ops import hidden_bits, masked_fill_hidden

SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
                  torch.float32: torch.int32, torch.float64: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.view(SAME_WIDTH_INT[a.dtype]), b.view(SAME_WIDTH_INT[b.dtype])))


@pytest.mark.parametrize("dtype", list(SAME_WIDTH_INT))
def test_masked_fill_hidden_is_masked_fill_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.rand(2, 1, 5, 7, generator=g) < 0.5
    scores = torch.randn(2, 3, 5, 7, generator=g).to(dtype)
    scores[0, 0, 0, :4] = torch.tensor([float("nan"), -0.0, torch.inf, -torch.inf]).to(dtype)
    scores.requires_grad_()
    grad = torch.randn(2, 3, 5, 7, generator=g).to(dtype)
    grad[0, 1, 1, :2] = torch.tensor([-0.0, float("nan")]).to(dtype)
    ours = masked_fill_hidden(scores, hidden_bits(hidden, dtype))
    plain = scores.masked_fill(hidden, -torch.inf)
    assert same_bits(ours.detach(), plain.detach())
    (ours_grad,) = torch.autograd.grad(ours, scores, grad)
    (plain_grad,) = torch.autograd.grad(plain, scores, grad)
    assert same_bits(ours_grad, plain_grad)


def plain_reference(q, key_sets, sink):
    """The reference read as plain torch calls on the views it is given (what
    ced.attention._read_reference computed before ced.exact_ops)."""
    b, h, c, _ = q.shape
    logits = [torch.matmul(q, ks.k.transpose(-1, -2)).masked_fill(ks.hidden, -torch.inf)
              for ks in key_sets]
    logits.append(sink.view(1, h, 1, 1).to(q.dtype).expand(b, h, c, 1))
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out, at = None, 0
    for ks in key_sets:
        read = torch.matmul(probs[..., at:at + ks.width], ks.v)
        at += ks.width
        out = read if out is None else out + read
    return out


@pytest.mark.parametrize("autocast", [True, False])
def test_reference_read_keeps_the_bits_of_plain_calls(autocast):
    """A block as `attend` hands it in a bf16 training step: a slice of the queries, a window
    slice of bf16 K/V, a prefix of fp32 global entries (cast by autocast), a sink."""
    g = torch.Generator().manual_seed(1)
    b, h, t, dh, c0, c1, e = 2, 4, 192, 16, 64, 128, 96
    dtype = torch.bfloat16 if autocast else torch.float32
    q_all = torch.randn(b, h, t, dh, generator=g).to(dtype).requires_grad_()
    window_k = torch.randn(b, h, t, dh, generator=g).to(dtype).requires_grad_()
    window_v = torch.randn(b, h, t, dh, generator=g).to(dtype).requires_grad_()
    entry_k = torch.randn(b, h, e, dh, generator=g).requires_grad_()
    entry_v = torch.randn(b, h, e, dh, generator=g).requires_grad_()
    sink = torch.randn(h, generator=g).requires_grad_()
    window_hidden = torch.rand(1, 1, c1 - c0, c1 - c0 + 7, generator=g) < 0.5
    entry_hidden = torch.rand(b, 1, c1 - c0, 64, generator=g) < 0.7
    leaves = (q_all, window_k, window_v, entry_k, entry_v, sink)
    grad = torch.randn(b, h, c1 - c0, dh, generator=g).to(dtype)

    def run(read):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
                attention_kernel("reference"):
            sets = [KeySet(window_k[:, :, c0 - 7:c1], window_v[:, :, c0 - 7:c1], window_hidden),
                    KeySet(entry_k[:, :, :64], entry_v[:, :, :64], entry_hidden)]
            out = read(q_all[:, :, c0:c1], sets, sink)
        return out, torch.autograd.grad(out, leaves, grad.to(out.dtype))

    ours, ours_grads = run(lambda q, sets, sink: joint_read(q, sets, sink, masks={})[0])
    plain, plain_grads = run(plain_reference)
    assert same_bits(ours, plain)
    for a, p in zip(ours_grads, plain_grads):
        assert same_bits(a, p)
