"""benchmarks/picks.py: the union of a query block's top-k picks, read from a model's own
forward. On a saved tiny model every block's union lies between its last query's picks and
the entries it reads, the summary's ratios are those sums, and the model's `attend` is put
back afterwards. Nothing here is timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import ced.model as model_module
from ced.checkpoint import save_model
from tests.conftest import make_model, tiny_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import picks  # noqa: E402


def test_each_block_union_lies_between_one_query_and_the_masked_read(tmp_path):
    topk = 4
    cfg = tiny_config(n_decoder_layers=2, window=4, topk=topk, max_seq_len=64,
                      attention_block=16, vocab_size=259)
    save_model(make_model(cfg, 0).float(), tmp_path / "final")
    attend = model_module.attend
    records = picks.read_picks(tmp_path / "final", rows=3, seq_len=64)
    assert model_module.attend is attend
    table = np.array(records, dtype=float)
    assert len(table) and set(table[:, 0]) >= {1.0}
    ratio, start, n_read, union = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    assert (union <= n_read).all() and (union >= np.minimum(topk, n_read)).all()
    assert set(start) == {0, 16, 32, 48}
    # the blocks of one call and row: n_read grows with the block's start
    for r in set(ratio):
        part = table[ratio == r]
        assert (np.diff(part[part[:, 1].argsort(kind="stable"), 2]) >= 0).all()
    summary = {(row["compress_ratio"], row["block_start"]): row for row in picks.summary(records)}
    masked = table[table[:, 4] > 0]
    for r in set(ratio):
        part = masked[masked[:, 0] == r]
        if len(part):
            assert summary[(int(r), "all")]["union_over_n_read_masked"] == \
                part[:, 3].sum() / part[:, 2].sum()
    out = tmp_path / "picks.json"
    assert picks.main([str(tmp_path / "final"), "--rows", "2", "--seq-len", "64",
                       "--json", str(out)]) == 0
    assert {row["block_start"] for row in json.loads(out.read_text())} >= {"all", 0, 48}


def test_a_model_without_a_top_k_read_or_too_little_text_is_refused(tmp_path, capsys):
    save_model(make_model(tiny_config(n_decoder_layers=2, window=4, topk=None, max_seq_len=64,
                                      vocab_size=259), 0).float(), tmp_path / "dense_read")
    assert picks.main([str(tmp_path / "dense_read"), "--rows", "1", "--seq-len", "64"]) == 2
    assert "no top-k read" in capsys.readouterr().err
    assert picks.main([str(tmp_path / "dense_read"), "--rows", "100000", "--seq-len",
                       "64"]) == 2
    assert "exceeds the held-out text" in capsys.readouterr().err
