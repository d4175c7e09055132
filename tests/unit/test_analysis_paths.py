"""analysis.paths on a fabricated evals.paths table: only competent bins beyond the cut count,
and only the answers `full` gets right; the cell interval is over models; the correlation reads
each model's smallest N."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.paths import by_distance, cells, competent_rows, correlations, per_model, write

READINGS = ("full", "replay", "global_cut", "both")


def fabricated(models: dict[str, float], n: int = 40, seed: int = 0,
               bins=((8, 1.0), (2, 1.0), (16, 0.3))) -> pd.DataFrame:
    """Per model (job J, seeds 0..): one competent bin beyond N = 4 (d = 8, full always right)
    where the chain keeps a share `chain` of the answers and the global read a share 0.5, one
    bin inside the replay (d = 2), and one bin full fails (d = 16: never counted)."""
    rng = np.random.default_rng(seed)
    rows = []
    for seed_, (model, chain) in enumerate(models.items()):
        for d, full in bins:
            for i in range(n):
                got = {"full": int(rng.random() < full)}
                got["global_cut"] = int(got["full"] and i < chain * n)
                got["replay"] = int(got["full"] and i % 2 == 0)
                got["both"] = 0
                rows += [{"job": "J", "seed": seed_, "model": model, "family": "f", "x": d,
                          "id": f"{d}/{i}", "distance": d, "chance": 0.0, "N": 4,
                          "reading": r, "correct": got[r], "nll": 0.0} for r in READINGS]
    return pd.DataFrame(rows)


def test_only_competent_bins_beyond_the_cut_count():
    rows = fabricated({"J/seed0": 0.75})
    assert set(competent_rows(rows)["x"]) == {8, 2}
    table = per_model(rows).set_index("path")
    assert (table["n"] == 40).all()                       # the d = 8 bin only
    assert math.isclose(table.loc["chain", "retained"], 0.75)
    assert math.isclose(table.loc["global", "retained"], 0.5)
    assert table.loc["encoder", "retained"] == 0
    distance = by_distance(rows).set_index("path")
    assert distance["distance"].tolist() == [8, 8, 8]      # d = 2 is inside the replay
    assert math.isclose(distance.loc["chain", "retained"], 0.75)


def test_only_answers_full_gets_right_count():
    """A bin where full is competent but misses some answers: the missed ones are not counted
    as kept or lost by any path."""
    rows = fabricated({"J/seed0": 1.0})
    missed = rows["id"].isin({"8/0", "8/1"})
    rows.loc[missed & (rows["reading"] == "full"), "correct"] = 0
    table = per_model(rows).set_index("path")
    assert (table["n"] == 38).all() and (table.loc["chain", "kept"] == 38)


def test_cells_and_correlations_over_models(tmp_path):
    chains = {"J/seed0": 0.25, "J/seed1": 0.5, "J/seed2": 0.75}
    rows = fabricated(chains)
    drops = pd.DataFrame({"job": "J", "seed": [0, 1, 2], "drop_beyond": [-0.1, -0.3, -0.6]})
    models = per_model(rows, drops)
    chain = cells(models).set_index("path").loc["chain"]
    assert chain["models"] == 3 and math.isclose(chain["retained"], 0.5)
    half = 4.302652729911275 * 0.25 / math.sqrt(3)
    assert math.isclose(chain["model_ci_high"] - chain["retained"], half, rel_tol=1e-9)
    rho = correlations(models).set_index("path")
    assert math.isclose(rho.loc["chain", "rho"], -1.0) and rho.loc["chain", "models"] == 3
    (tmp_path / "p").mkdir()
    rows.to_csv(tmp_path / "p" / "rows.csv", index=False)
    drops.to_csv(tmp_path / "models.csv", index=False)
    written = write(tmp_path / "p", tmp_path / "out", tmp_path / "models.csv",
                    archive=tmp_path / "archive")
    assert all(p.exists() for p in written.values())
    assert "| J | chain | 3 | 0.50 |" in written["paths_md"].read_text()
    # the archive reads back to the same tables, and its bytes do not depend on the time
    again = write(tmp_path / "archive", tmp_path / "again", tmp_path / "models.csv",
                  archive=tmp_path / "archive2")
    for name in ("paths", "paths_cells", "paths_by_distance"):
        assert written[name].read_bytes() == again[name].read_bytes(), name
    assert (written["paths_rows"].read_bytes() == again["paths_rows"].read_bytes())
    with pytest.raises(ValueError, match=r"--jobs: \['K'\] not in"):
        write(tmp_path / "p", tmp_path / "o", jobs=["K"])
    with pytest.raises(FileNotFoundError, match="neither rows.csv"):
        write(tmp_path / "out", tmp_path / "o")
    # an archive beside a later read: the models pooled, each in one folder only
    (tmp_path / "later").mkdir()
    later = rows[rows["seed"] == 2]
    rows[rows["seed"] < 2].to_csv(tmp_path / "p" / "rows.csv", index=False)
    later.to_csv(tmp_path / "later" / "rows.csv", index=False)
    pooled = write([tmp_path / "p", tmp_path / "later"], tmp_path / "pooled",
                   tmp_path / "models.csv")
    assert pooled["paths_cells"].read_bytes() == written["paths_cells"].read_bytes()
    with pytest.raises(ValueError, match="J/seed2 is read in both"):
        write([tmp_path / "later", tmp_path / "later"], tmp_path / "o")


def test_two_cuts_each_read_alone_and_the_smallest_leads():
    """Rows at N = 4 and N = 8 (full repeated under each, as evals.paths writes it): each N's
    shares come from its own rows (at N = 8 only the d = 12 bin lies beyond the cut); the
    by-distance table and the correlation read N = 4."""
    bins = ((8, 1.0), (12, 1.0), (2, 1.0))
    at4 = fabricated({"J/seed0": 0.75}, bins=bins)
    at8 = at4.assign(N=8)
    at8.loc[at8["reading"] == "global_cut", "correct"] = 0
    rows = pd.concat([at4, at8], ignore_index=True)
    table = per_model(rows).set_index(["N", "path"])
    assert math.isclose(table.loc[(4, "chain"), "retained"], 0.75)
    assert table.loc[(4, "chain"), "n"] == 80 and table.loc[(8, "chain"), "n"] == 40
    assert table.loc[(8, "chain"), "retained"] == 0
    distance = by_distance(rows).set_index(["distance", "path"])
    assert math.isclose(distance.loc[(12, "chain"), "retained"], 0.75)   # N = 4's rows


def test_a_pooled_cell_is_the_cell_of_its_jobs_models(tmp_path):
    """--pool: job J's seeds 0-1 and job K's seed 2 read as one cell equal J holding all three;
    the study folder layout (<job>/seed<k>/rows.csv, the driver's steps) reads as one table."""
    chains = {"J/seed0": 0.25, "J/seed1": 0.5, "J/seed2": 0.75}
    rows = fabricated(chains)
    drops = pd.DataFrame({"job": "J", "seed": [0, 1, 2], "drop_beyond": [-0.1, -0.3, -0.6]})
    whole = cells(per_model(rows, drops)).set_index(["N", "path"])
    split = rows.copy()
    moved = split["seed"] == 2
    split.loc[moved, "job"], split.loc[moved, "model"] = "K", "K/seed2"
    for (job, seed), part in split.groupby(["job", "seed"]):
        (tmp_path / "study" / job / f"seed{seed}").mkdir(parents=True)
        part.to_csv(tmp_path / "study" / job / f"seed{seed}" / "rows.csv", index=False)
    split_drops = drops.assign(job=["J", "J", "K"])
    split_drops.to_csv(tmp_path / "models.csv", index=False)
    written = write(tmp_path / "study", tmp_path / "out", tmp_path / "models.csv",
                    pools={"JK": ["J", "K"]})
    table = pd.read_csv(written["paths_cells"])
    assert set(table["job"]) == {"J", "K", "JK"}
    pooled = table[table["job"] == "JK"].set_index(["N", "path"])
    assert (pooled["pooled"] == "J+K").all()
    for column in ("models", "retained", "model_ci_low", "model_ci_high", "documents", "kept"):
        assert np.allclose(pooled[column], whole.loc[pooled.index, column]), column
    (tmp_path / "twin").mkdir()                 # seed 0 read in both jobs: refused
    pd.concat([rows, rows[rows["seed"] == 0].assign(job="K", model="K/seed0")]).to_csv(
        tmp_path / "twin" / "rows.csv", index=False)
    with pytest.raises(ValueError, match=r"seed\(s\) \[0\] in more than one"):
        write(tmp_path / "twin", tmp_path / "o", pools={"JK": ["J", "K"]})
