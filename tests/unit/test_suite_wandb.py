"""The suite's wandb tables: a column may not mix numbers and strings (wandb refuses the whole
table), and the capability-drop rows of a pooled x carry p_holm "" beside per-x numbers."""

from __future__ import annotations

import wandb

from evals.suites.runner import DROP_FIELDS, _table_row


def test_drop_table_with_pooled_and_per_x_rows_is_accepted_by_wandb():
    pooled = {"family": "recall", "x_name": "distance", "x": "all", "mode": "replay=1", "n": 550,
              "acc_full": 0.9, "acc_mode": 0.8, "delta": -0.1, "full_only": 60, "mode_only": 5,
              "p_value": 1e-9, "p_holm": "", "significant": 1}
    per_x = {**pooled, "x": 7, "n": 50, "p_holm": 0.28}
    rows = [_table_row(r, DROP_FIELDS) for r in (pooled, per_x)]
    assert rows[0][DROP_FIELDS.index("p_holm")] is None and rows[1][DROP_FIELDS.index("x")] == "7"
    table = wandb.Table(columns=DROP_FIELDS, data=rows)
    assert len(table.data) == 2
