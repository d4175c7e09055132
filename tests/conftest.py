"""Shared helpers: tiny float64 models with deliberately non-degenerate random weights, and
a driver that runs the inference engine over a prompt and then decodes teacher-forced tokens."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ced import CEDModel, InferenceEngine, ModelConfig  # noqa: E402

# Test tensors are tiny: intra-op threads only add overhead, and two xdist workers share 2 cores.
torch.set_num_threads(1)

# Exact-equivalence checks run in float64; the two sides differ only by summation order.
TOL = 1e-10
ROOT_CONF = Path(__file__).resolve().parents[1] / "conf"
VOCAB = 61


def tiny_config(variant: str = "ced", **overrides) -> ModelConfig:
    base = dict(variant=variant, vocab_size=VOCAB, d_model=16, n_heads=2, n_encoder_layers=3,
                n_decoder_layers=2, window=4, topk=None, global_from_layer=1,
                encoder_kv_groups=2, encoder_compress_ratio=2, decoder_compress_ratio=1,
                indexer_heads=2, indexer_dim=4, max_seq_len=256)
    base.update(overrides)
    return ModelConfig(**base)


def make_model(cfg: ModelConfig, seed: int) -> CEDModel:
    """A float64 model in eval mode whose weights are large enough that attention is far from
    uniform (the default 0.02 init would make most differences vanish into the tolerance)."""
    torch.manual_seed(seed)
    model = CEDModel(cfg).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
            elif name.endswith("weight"):        # norms
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:                                 # sinks, gate biases
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def random_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """Prompts full of repeats, the inputs that produce top-k near-ties: each row tiles a short
    motif (1 to 6 tokens from an alphabet of 2 to 5), so tokens and substrings longer than any
    receptive field recur, and a few positions are replaced by other tokens of the alphabet.
    Two global entries are then often equal in exact arithmetic while the parallel and
    incremental paths compute them with different kernels; the indexer's scores are rounded
    before the top-k (`ced.semantics.select_entries`) so that both paths still choose alike."""
    gen = torch.Generator().manual_seed(seed + 7919)
    rows = []
    for _ in range(batch):
        alphabet = torch.randperm(VOCAB, generator=gen)[:int(torch.randint(2, 6, (1,),
                                                                            generator=gen))]
        motif = alphabet[torch.randint(len(alphabet), (int(torch.randint(1, 7, (1,),
                                                                          generator=gen)),),
                                       generator=gen)]
        row = motif.repeat(length // len(motif) + 1)[:length].clone()
        noise = torch.rand(length, generator=gen) < 0.15
        row[noise] = alphabet[torch.randint(len(alphabet), (int(noise.sum()),), generator=gen)]
        rows.append(row)
    return torch.stack(rows)


def distinct_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """Distinct tokens within each row (no repeats at all), for checks that need every position
    to be told apart."""
    if length > VOCAB:
        raise ValueError(f"distinct_ids: length {length} > VOCAB {VOCAB}")
    gen = torch.Generator().manual_seed(seed + 7919)
    return torch.stack([torch.randperm(VOCAB, generator=gen)[:length] for _ in range(batch)])


def engine_logits(model: CEDModel, ids: torch.Tensor, prompt_len: int, replay=None) -> torch.Tensor:
    """Prefill ids[:, :prompt_len] with `replay`, then decode ids[:, prompt_len:] one by one.
    Returns logits [B, n, V] for positions prompt_len - 1 .. ids.shape[1] - 1."""
    engine = InferenceEngine(model)
    out = engine.prefill(ids[:, :prompt_len], replay=replay)
    logits = [out.logits]
    for t in range(prompt_len, ids.shape[1]):
        logits.append(engine.decode(ids[:, t], out.cache))
    return torch.stack(logits, dim=1)


@st.composite
def configs(draw, variants=("dense", "swa", "yoco", "ced")) -> ModelConfig:
    """Small valid configs spanning the schedule space: windows from 1, ratios that may not
    divide T, every group split, top-k from 1 to read-all, tiny attention blocks (chunking)."""
    variant = draw(st.sampled_from(variants))
    window = draw(st.integers(1, 6))
    enc_ratio = draw(st.integers(1, min(3, window)))
    dec_ratio = 1 if variant == "yoco" else draw(st.integers(1, min(3, window)))
    n_enc = draw(st.integers(1, 4))
    gfl = draw(st.integers(0, n_enc))
    heads = draw(st.sampled_from([1, 2]))
    return ModelConfig(
        variant=variant, vocab_size=VOCAB, d_model=8 * heads, n_heads=heads,
        n_encoder_layers=n_enc, n_decoder_layers=draw(st.integers(1, 3)), window=window,
        topk=draw(st.one_of(st.none(), st.integers(1, 6))), global_from_layer=gfl,
        encoder_kv_groups=0 if gfl == n_enc else draw(st.integers(1, n_enc - gfl)),
        encoder_compress_ratio=enc_ratio, decoder_compress_ratio=dec_ratio,
        decoder_reindex_every=draw(st.sampled_from([None, 1, 2])), indexer_heads=2,
        indexer_dim=4, attention_sink=draw(st.booleans()),
        global_kv_heads=draw(st.sampled_from([None, 1])),
        attention_block=draw(st.sampled_from([1, 3, 128])),
        shift_tokens=draw(st.sampled_from([0, 0, 1, 3])), max_seq_len=128)


# The files whose tests train models take minutes; pytest-xdist (--dist loadfile) hands files
# to its workers in queue order, so when these come last one worker runs them alone while the
# other idles. Collected first, the short files fill in behind them (longest first: the
# 10-minute CI budget on 2 cores). xdist would re-sort the queue by tests per file (its
# default loadscope reorder, which put the 1-test recall file last: a 2-3 minute tail with one
# worker busy), so `make test` passes --no-loadscope-reorder. Seconds per file beside another
# worker (--junitxml, summed per file, beside a one-thread training on
# the same 2 cores; test_demo's study is a module fixture, counted at about 100 s before).
SLOW_FILES = {"test_train.py": 119, "test_sweeps.py": 108,
              "test_demo.py": 100, "test_faults.py": 89, "test_daily_loop.py": 81,
              "test_invariants.py": 62, "test_recipe.py": 53, "test_hydra_configs.py": 49,
              "test_run_safety.py": 44, "test_lm_eval.py": 33, "test_registry.py": 30,
              "test_divergence.py": 24, "test_eval_args.py": 22, "test_recipe_levers.py": 22,
              "test_flops.py": 20, "test_real_text_study.py": 100}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))   # stable: order kept within
