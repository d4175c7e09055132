"""The two kernels of the joint softmax read (ced.attention.joint_read) compute the same thing.

The fused CPU flash kernel runs one call per key set and merges the partial reads through their
log-sum-exps, with a hand-written backward; the reference concatenates logits and takes one
softmax. They must agree, forward and backward, on every mask shape `attend` builds (rows with
no visible key in a set, broadcast masks, a sink), in float64 to 1e-12."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ced.attention as attention_module
from ced import CEDModel, ModelConfig
from ced.attention import KeySet, attention_kernel, joint_read, set_attention_kernel
from ced.model import MLP

pytestmark = pytest.mark.skipif(attention_module._FLASH_FORWARD is None,
                                reason="this torch build has no fused CPU attention kernel")
TOL = 1e-12   # float64; the kernels differ only in summation order


def random_key_sets(seed: int, batch: int, heads: int, queries: int, widths: list[int],
                    dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    sets = []
    for i, width in enumerate(widths):
        k = torch.randn(batch, heads, width, 8, generator=g, dtype=dtype)
        v = torch.randn(batch, heads, width, 8, generator=g, dtype=dtype)
        # alternate per-row masks [B, 1, C, S] and broadcast ones [1, 1, C, S]
        rows = batch if i % 2 == 0 else 1
        hidden = torch.rand(rows, 1, queries, width, generator=g) < 0.6
        hidden[:, :, 0] = True                     # a query that sees nothing in this set
        sets.append(KeySet(k.requires_grad_(), v.requires_grad_(), hidden))
    q = torch.randn(batch, heads, queries, 8, generator=g, dtype=dtype).requires_grad_()
    sink = torch.randn(heads, generator=g, dtype=dtype).requires_grad_()
    return q, sets, sink


def run(kernel: str, q, sets, sink, probs_of):
    leaves = [q, sink] + [t for ks in sets for t in (ks.k, ks.v)]
    for t in leaves:
        t.grad = None
    with attention_kernel(kernel):
        out, probs = joint_read(q, sets, sink, probs_of)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), probs[probs_of].detach(), [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("widths", [[7], [5, 11], [3, 9, 4]])
def test_fused_and_reference_reads_agree(seed, widths):
    q, sets, sink = random_key_sets(seed, batch=2, heads=3, queries=6, widths=widths)
    ref = run("reference", q, sets, sink, probs_of=len(sets) - 1)
    fused = run("auto", q, sets, sink, probs_of=len(sets) - 1)
    # query 0 sees nothing in any set: only the sink is in its denominator, the output is 0
    assert torch.equal(fused[0][:, :, 0], torch.zeros_like(fused[0][:, :, 0]))
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=TOL)
    torch.testing.assert_close(fused[1], ref[1], rtol=0, atol=TOL)
    for got, want in zip(fused[2], ref[2]):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_fused_read_without_sink_and_with_an_empty_set():
    q, sets, _ = random_key_sets(3, batch=2, heads=2, queries=5, widths=[6, 4])
    for ks in sets:
        ks.hidden[:, :, 0] = False                 # every query sees something
    sets.append(KeySet(sets[0].k[:, :, :0], sets[0].v[:, :, :0], sets[0].hidden[..., :0]))
    with attention_kernel("reference"):
        ref, _ = joint_read(q, sets, None)
    fused, _ = joint_read(q, sets, None)
    torch.testing.assert_close(fused, ref, rtol=0, atol=TOL)


def test_the_fused_kernel_is_the_one_that_runs_on_cpu(monkeypatch):
    calls = []
    original = attention_module._FlashRead.apply
    monkeypatch.setattr(attention_module._FlashRead, "apply",
                        lambda *a: calls.append(1) or original(*a))
    q, sets, sink = random_key_sets(0, batch=1, heads=2, queries=4, widths=[5])
    joint_read(q, sets, sink)
    assert calls, "auto did not take the fused kernel on CPU float64"
    calls.clear()
    with attention_kernel("reference"):
        joint_read(q, sets, sink)
    assert not calls
    index = torch.randint(0, 5, (1, 4, 3))
    gathered = KeySet(torch.randn(1, 2, 5, 8, dtype=torch.float64),
                      torch.randn(1, 2, 5, 8, dtype=torch.float64),
                      torch.zeros(1, 1, 4, 3, dtype=torch.bool), gathered=True, index=index)
    joint_read(q, [gathered], sink)
    assert calls, "a gathered top-k set in float64 is read inside the fused node"
    calls.clear()
    one = KeySet(gathered.k, gathered.v, gathered.hidden[:, :, :1], gathered=True,
                 index=index[:, :1])
    joint_read(q[:, :, :1], [one], sink)
    assert not calls, "one query (a decode step): the reference reads a gathered set"
    bf16 = KeySet(gathered.k.bfloat16(), gathered.v.bfloat16(), gathered.hidden, gathered=True,
                  index=index)
    joint_read(q.detach().bfloat16(), [bf16], sink.detach().bfloat16())
    assert not calls, "in bf16 a gathered set stays with the reference"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("plain_widths", [[], [6], [5, 9]])
def test_gathered_sets_in_the_fused_node_agree_with_the_reference(seed, kv_heads, plain_widths):
    """A gathered top-k set (entries [B, G, E, Dh], G K/V heads for 4 query heads, and 5 picks
    a query, some picked twice as padding slots are) beside plain sets: outputs, its
    probabilities and every gradient (the entries' included) as the reference computes them
    by copying the picked rows, including query rows that see none of its slots."""
    q, sets, sink = random_key_sets(seed, batch=2, heads=4, queries=6, widths=plain_widths)
    g = torch.Generator().manual_seed(100 + seed)
    k = torch.randn(2, kv_heads, 7, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, kv_heads, 7, 8, generator=g, dtype=torch.float64).requires_grad_()
    index = torch.randint(0, 7, (2, 6, 5), generator=g)
    hidden = torch.rand(2, 1, 6, 5, generator=g) < 0.4
    hidden[:, :, 0] = True                           # no valid slot for query 0
    sets.append(KeySet(k, v, hidden, gathered=True, index=index))
    ref = run("reference", q, sets, sink, probs_of=len(sets) - 1)
    fused = run("auto", q, sets, sink, probs_of=len(sets) - 1)
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=TOL)
    torch.testing.assert_close(fused[1], ref[1], rtol=0, atol=TOL)
    for got, want in zip(fused[2], ref[2]):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_the_fused_node_reads_picked_entries_in_place(monkeypatch):
    """Forward and backward of a gathered set in the fused node never copy the picked rows
    (k rows per query and head: the copy made the read memory-bound and held a gigabyte a
    layer at 8k tokens); only the reference read does."""
    q, sets, sink = random_key_sets(1, batch=2, heads=4, queries=6, widths=[5])
    g = torch.Generator().manual_seed(7)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64).requires_grad_()
    sets.append(KeySet(k, v, torch.zeros(2, 1, 6, 4, dtype=torch.bool), gathered=True,
                       index=torch.randint(0, 9, (2, 6, 4), generator=g)))
    copies = []
    original = attention_module._GatherRows.apply
    monkeypatch.setattr(attention_module._GatherRows, "apply",
                        lambda *a: copies.append(1) or original(*a))
    run("auto", q, sets, sink, probs_of=1)
    assert not copies
    run("reference", q, sets, sink, probs_of=1)
    assert copies, "the reference copies the rows (the check above can see a copy)"


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_outer_is_the_sum_of_outer_products_over_each_head_group(kv_heads):
    """The rows' gradient kernel: [B, G, C, k, Dh] = sum over the query heads of each K/V group
    of a[h, c, j] x[h, c, d]. With one head a group it is the outer product itself, taken by
    broadcasting, which must equal the product in float32 bit for bit (no summation)."""
    g = torch.Generator().manual_seed(kv_heads)
    a = torch.randn(2, 4, 6, 5, generator=g)
    x = torch.randn(2, 4, 6, 8, generator=g)
    got = attention_module._grouped_outer(a, x, kv_heads)
    want = torch.einsum("bgicj,bgicd->bgcjd", a.double().view(2, kv_heads, 4 // kv_heads, 6, 5),
                        x.double().view(2, kv_heads, 4 // kv_heads, 6, 8))
    assert got.shape == (2, kv_heads, 6, 5, 8)
    if kv_heads == 4:
        assert torch.equal(got, want.float())
    else:
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="attention kernel: must be one of"):
        set_attention_kernel("triton")


def test_fused_read_in_bf16_is_close_to_the_reference():
    q, sets, sink = random_key_sets(1, batch=2, heads=2, queries=8, widths=[9, 6],
                                    dtype=torch.float32)
    q16 = q.detach().bfloat16()
    sets16 = [KeySet(ks.k.detach().bfloat16(), ks.v.detach().bfloat16(), ks.hidden)
              for ks in sets]
    with attention_kernel("reference"):
        ref, _ = joint_read(q16.float(), [KeySet(ks.k.float(), ks.v.float(), ks.hidden)
                                          for ks in sets16], sink.detach().float())
    fused, _ = joint_read(q16, sets16, sink.detach())
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), ref, rtol=0, atol=2e-2)


# (variant, topk, extra config): "gather" reads every top-k block gathered, inside the fused
# node in float64 (with 1 K/V head as well); "union" reads each block's union of picks as one
# more parent of the node
MODEL_CASES = [("dense", None, {}), ("swa", None, {}), ("yoco", None, {}), ("ced", None, {}),
               ("ced", 4, {}), ("ced", 4, {"global_read": "gather"}),
               ("ced", 3, {"global_read": "gather", "global_kv_heads": 1}),
               ("ced", 3, {"global_read": "union", "global_kv_heads": 1})]


@pytest.mark.parametrize("variant,topk,extra", MODEL_CASES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("starts", [True, False])
def test_whole_model_agrees_between_kernels(variant, topk, extra, seed, starts):
    """Logits, indexer KL and every parameter gradient, with or without document starts and
    per-row decoder replay starts (without them, dense and yoco's decoder take the one-block
    causal form), query blocks that cut windows, in float64."""
    torch.manual_seed(seed)
    cfg = ModelConfig(variant=variant, d_model=32, n_heads=2, n_encoder_layers=4,
                      n_decoder_layers=2, encoder_kv_groups=2, window=5, topk=topk,
                      decoder_reindex_every=1, attention_block=7, shift_tokens=2, **extra)
    model = CEDModel(cfg).double()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sink.normal_()
    ids = torch.randint(0, cfg.vocab_size, (3, 29))
    docs = torch.tensor([[0, 11], [0, 0], [0, 20]]) if starts else None
    replay = torch.tensor([25, 3, 14]) if cfg.has_decoder and starts else None
    results = {}
    for kernel in ("reference", "auto"):
        model.zero_grad()
        with attention_kernel(kernel):
            logits, aux = model(ids, return_aux=True, document_starts=docs,
                                decoder_replay_start=replay)
        (logits.pow(2).mean() + aux["indexer_kl"]).backward()
        results[kernel] = (logits.detach(), aux["indexer_kl"].detach(),
                           {n: p.grad.clone() for n, p in model.named_parameters()
                            if p.grad is not None})
    ref, fused = results["reference"], results["auto"]
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=TOL)
    torch.testing.assert_close(fused[1], ref[1], rtol=0, atol=TOL)
    assert fused[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(fused[2][name], ref[2][name], rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("variant,expected", [("dense", 4), ("yoco", 2), ("swa", 0), ("ced", 0)])
def test_plain_causal_reads_run_as_one_causal_call(monkeypatch, variant, expected):
    """Full-causal layers (dense) and yoco's ratio-1 decoder read are one causal call each;
    windows and compressed or document-masked reads keep their masks."""
    causal_calls = []
    original = attention_module._FlashRead.apply
    monkeypatch.setattr(attention_module._FlashRead, "apply", lambda *a: causal_calls.extend(
        fs.causal for _, _, sets in a[2] for fs in sets if fs.causal) or original(*a))
    cfg = ModelConfig(variant=variant, d_model=32, n_heads=2, n_encoder_layers=2,
                      n_decoder_layers=2, encoder_kv_groups=0, global_from_layer=2, window=5,
                      attention_block=7)
    model = CEDModel(cfg)
    model(torch.randint(0, cfg.vocab_size, (2, 30)))
    assert len(causal_calls) == expected
    causal_calls.clear()
    model(torch.randint(0, cfg.vocab_size, (2, 30)), document_starts=torch.tensor([0, 9]))
    assert not causal_calls


@pytest.mark.parametrize("variant,topk", [("swa", None), ("ced", 4), ("ced", None)])
def test_every_query_block_of_a_layer_is_one_autograd_node(monkeypatch, variant, topk):
    """All query blocks of one attention call go through one fused node (a node per block
    made autograd zero-fill and sum a whole-size gradient of q and K/V per block), so a
    forward makes one fused call per layer however many blocks T / attention_block is."""
    calls = []
    original = attention_module._FlashRead.apply
    monkeypatch.setattr(attention_module._FlashRead, "apply",
                        lambda *a: calls.append(len(a[2])) or original(*a))
    cfg = ModelConfig(variant=variant, d_model=32, n_heads=2, n_encoder_layers=2,
                      n_decoder_layers=2, encoder_kv_groups=1, global_from_layer=1,
                      window=5, topk=topk, attention_block=7, global_read="masked")
    CEDModel(cfg)(torch.randint(0, cfg.vocab_size, (2, 30)))
    assert len(calls) == cfg.n_encoder_layers + cfg.n_decoder_layers
    assert all(n == 5 for n in calls)          # ceil(30 / 7) blocks in each


@pytest.mark.parametrize("seed", range(3))
def test_blocked_fused_read_matches_the_reference_block_by_block(seed):
    """`_FlashRead` over a plan of query blocks (slices of shared K/V parents, one block that
    reads nothing) equals the reference read of each block, forward and every gradient, in
    float64 to 1e-12."""
    from ced.attention import _FlashRead, _flash_set
    q, sets, sink = random_key_sets(seed, batch=2, heads=3, queries=9, widths=[12, 12])
    parents = [t for ks in sets for t in (ks.k, ks.v)]
    cuts = [(0, 4, 0, 7), (4, 6, 3, 12), (6, 9, 0, 0)]          # (c0, c1, keys a:z) per block

    def block_sets(c0, c1, a, z):
        return [KeySet(ks.k[:, :, a:z], ks.v[:, :, a:z], ks.hidden[:, :, c0:c1, a:z])
                for ks in sets]

    weights = torch.linspace(-1, 1, q.numel(), dtype=q.dtype).view_as(q)
    plan = [(c0, c1, tuple(_flash_set(ks, 2 * i, a, q) for i, ks in
                           enumerate(block_sets(c0, c1, a, z)) if ks.width > 0))
            for c0, c1, a, z in cuts]
    out, _ = _FlashRead.apply(q, sink, plan, *parents)
    grads = torch.autograd.grad((out * weights).sum(), [q, sink, *parents])
    with attention_kernel("reference"):
        outs = [joint_read(q[:, :, c0:c1], block_sets(c0, c1, a, z), sink)[0]
                for c0, c1, a, z in cuts]
    ref = torch.cat([o if o is not None else q.new_zeros(2, 3, 3, 8) for o in outs], dim=2)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [q, sink, *parents])
    assert torch.equal(out[:, :, 6:], torch.zeros_like(out[:, :, 6:]))
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_fused_training_step_is_bitwise_reproducible():
    cfg = ModelConfig(variant="ced", d_model=32, n_heads=2, n_encoder_layers=4,
                      n_decoder_layers=2, encoder_kv_groups=2, window=5, topk=4,
                      attention_block=8)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        model = CEDModel(cfg)
        logits, aux = model(ids, return_aux=True)
        (F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
         + aux["indexer_kl"]).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("ff", [683, 16, 17, 40])
def test_padded_mlp_is_the_unpadded_swiglu(ff):
    torch.manual_seed(ff)
    cfg = ModelConfig(variant="dense", d_model=32, n_heads=2, n_encoder_layers=1,
                      n_decoder_layers=1, d_ff=ff)
    mlp = MLP(cfg).double()
    assert mlp.gate_up.weight.shape == (2 * ff, 32) and mlp.down.weight.shape == (32, ff)
    x = torch.randn(3, 5, 32, dtype=torch.float64)

    def plain() -> torch.Tensor:
        gate, up = F.linear(x, mlp.gate_up.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, mlp.down.weight)

    torch.testing.assert_close(mlp(x), plain(), rtol=0, atol=TOL)
    mlp(x).sum().backward()
    padded = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    plain().sum().backward()
    for got, p in zip(padded, mlp.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=0, atol=TOL)


def rotary_by_definition(x, positions, theta):
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


@pytest.mark.parametrize("seed", range(4))
def test_rotary_matches_its_definition_and_gradcheck(seed):
    """ced.semantics.rotary (in-place products, inverse-rotation backward) against the textbook
    form; gradcheck in float64, on a transposed (non-contiguous) input as the model passes."""
    from ced.semantics import rotary
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 3, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    positions = torch.randint(0, 5000, (9,), generator=g)
    torch.testing.assert_close(rotary(x, positions, 500.0),
                               rotary_by_definition(x, positions, 500.0), rtol=0, atol=TOL)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rotary(t, positions, 500.0), (x,))
