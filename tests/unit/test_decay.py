"""analysis.decay on fabricated kl_by_position tables: exponential decays with known tau, per
token or per window, read back through checkpoint configs written as training writes them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis import decay
from ced.config import ModelConfig

# off-curve values where the fit must not look: below W (the first window is cut too), at and
# after R_exact (above the floor on purpose: only the distance rule keeps them out) and a few
# readings at rounding level inside the fitted range
BEFORE_W, FROM_R_EXACT, ROUNDING = 1.0, 1e-4, 1e-12


def write_config(root, job: str, seed: int, window: int, layers: int, encoder: int = 2):
    """runs/<job>/seed<k>/final/config.json under root, as ced.checkpoint.save_model writes it."""
    final = root / "runs" / job / f"seed{seed}" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps(ModelConfig(
        variant="ced", n_encoder_layers=encoder, n_decoder_layers=layers, window=window,
        encoder_kv_groups=0).to_dict()))
    return final


def curve(window: int, layers: int, tau: float, amplitude: float, noise: float,
          rng: np.random.Generator, rounding_every: int = 0) -> pd.DataFrame:
    """distance, bytes, kl_mean for d = 1 .. R_exact + W - 1: amplitude exp(-(d - W) / tau)
    with log-normal noise on W <= d < R_exact (every `rounding_every`-th of them at rounding
    level when given), and off-curve values elsewhere."""
    r_exact = layers * (window - 1) + 1
    d = np.arange(1, r_exact + window)
    kl = amplitude * np.exp(-(d - window) / tau + rng.normal(0, noise, d.size))
    kl[d < window] = BEFORE_W
    kl[d >= r_exact] = FROM_R_EXACT
    if rounding_every:
        inside = np.flatnonzero((d >= window) & (d < r_exact))
        kl[inside[1::rounding_every]] = ROUNDING
    return pd.DataFrame({"distance": d, "bytes": rng.integers(9000, 11000, d.size),
                         "kl_mean": kl, "kl_median": kl / 3, "kl_max": kl * 50,
                         "kl_p99": kl * 10})


def fabricate(root, law: str, seed: int = 0, windows=(8, 16, 32), layers: int = 4,
              models: int = 4, spread: float = 0.05, noise: float = 0.1,
              rounding_every: int = 0) -> tuple[pd.DataFrame, dict]:
    """A kl_by_position table of `models` per W (one cell per W at L_d = layers) whose tau is
    3 bytes at every W (law per_token) or 0.4 W (per_window), each model's tau scattered by
    exp(N(0, spread)); and {checkpoint: its true tau}."""
    rng = np.random.default_rng(seed)
    parts, truth = [], {}
    for window in windows:
        for k in range(models):
            final = write_config(root, f"L{layers}_W{window}", k, window, layers)
            tau = (3.0 if law == "per_token" else 0.4 * window) * np.exp(rng.normal(0, spread))
            truth[str(final)] = tau
            parts.append(curve(window, layers, tau, 0.05 * np.exp(rng.normal(0, 0.3)), noise,
                               rng, rounding_every).assign(checkpoint=str(final)))
    table = pd.concat(parts, ignore_index=True)
    return table[["checkpoint", *[c for c in table if c != "checkpoint"]]], truth


def test_the_fit_recovers_tau_and_ignores_what_lies_outside_its_range(tmp_path):
    """Every model's tau within 5% of its truth, though below W, from R_exact on and at the
    rounding readings the table holds values that would pull the fit off if they counted."""
    table, truth = fabricate(tmp_path, "per_window", rounding_every=4)
    models = decay.fit_models(table, None)
    fitted = models.set_index("checkpoint")["tau"]
    for checkpoint, tau in truth.items():
        assert fitted[checkpoint] == pytest.approx(tau, rel=0.05)
    for m in models.itertuples():
        part = table[table["checkpoint"] == m.checkpoint]
        inside = part[(part["distance"] >= m.W) & (part["distance"] < m.R_exact)]
        assert m.distances == int((inside["kl_mean"] > decay.FLOOR).sum())
        assert m.R_exact == 4 * (m.W - 1) + 1 and m.per_byte_factor == pytest.approx(
            np.exp(1 / m.tau))
        # the same readings with the off-range values counted: the fit is far off
        everything = decay.fit_decay(part["distance"].to_numpy(float),
                                     part["kl_mean"].to_numpy(float),
                                     part["bytes"].to_numpy(float), m.W, 10 ** 6, 0.0)
        assert not everything["tau"] == pytest.approx(truth[m.checkpoint], rel=0.2)


def test_each_exclusion_on_its_own_matters():
    """Dropping one rule at a time (a W of 1, an R_exact past the table, a zero floor) moves
    tau off the truth: each rule is what keeps its values out."""
    rng = np.random.default_rng(3)
    table = curve(16, 4, 6.0, 0.05, 0.0, rng, rounding_every=4)
    d, kl, w = (table[c].to_numpy(float) for c in ("distance", "kl_mean", "bytes"))
    assert decay.fit_decay(d, kl, w, 16, 61)["tau"] == pytest.approx(6.0, rel=1e-6)
    # W = 1 shifts d - W, which moves only A: tau moves because the values below 16 count
    for window, r_exact, floor in ((1, 61, decay.FLOOR), (16, 10 ** 6, decay.FLOOR),
                                   (16, 61, 0.0)):
        tau = decay.fit_decay(d, kl, w, window, r_exact, floor)["tau"]
        assert not tau == pytest.approx(6.0, rel=0.1), (window, r_exact, floor)


@pytest.mark.parametrize("law", ["per_token", "per_window"])
def test_the_laws_find_the_true_one(tmp_path, law):
    """Over five fabricated studies (3 cells of 4 models): the true law wins on held-out cells
    every time; beta's t-interval covers the truth (0 per token, 1 per window) every time and
    neither interval covers the other law's value; the within-cell bootstrap CI covers the
    truth in at least 4 of 5 (with 4 models a cell it did in 93% of 30 seeds: a bootstrap over
    so few models runs narrow); per cell the t-interval of mean tau covers the cell's truth."""
    beta, other = (0.0, 1.0) if law == "per_token" else (1.0, 0.0)
    covered = 0
    for seed in range(5):
        table, truth = fabricate(tmp_path / str(seed), law, seed)
        models = decay.fit_models(table, None)
        laws, errors = decay.compare_laws(decay.law_frame(models), resamples=200, seed=seed)
        row = laws.set_index("law").loc["exponent"]
        assert row["estimate_t_low"] <= beta <= row["estimate_t_high"], seed
        covered += bool(row["estimate_ci_low"] <= beta <= row["estimate_ci_high"])
        for low, high in (("estimate_ci_low", "estimate_ci_high"),
                          ("estimate_t_low", "estimate_t_high")):
            assert not row[low] <= other <= row[high], seed
        best = laws.set_index("law").loc[law]
        assert best["best"] and best["held_out_rmse"] < 0.1, seed
        assert set(errors["job"]) == {"L4_W8", "L4_W16", "L4_W32"}
        cells = decay.cell_table(models, resamples=200)
        true_mean = models.assign(true=models["checkpoint"].map(truth)).groupby("job")["true"]
        for c in cells.itertuples():
            assert c.tau_t_low <= true_mean.mean()[c.job] <= c.tau_t_high, (seed, c.job)
            assert c.tau_over_W_mean == pytest.approx(c.tau_mean / c.W)
    assert covered >= 4


def test_the_cli_writes_its_files_reading_configs_from_an_archive(tmp_path, capsys):
    """Checkpoints whose directories are gone are read through --study's runs/; the outputs
    are written and the laws compared."""
    table, _ = fabricate(tmp_path / "archive", "per_token", models=3)
    table["checkpoint"] = table["checkpoint"].str.replace(str(tmp_path / "archive"),
                                                          "/gone/study", regex=False)
    table.to_csv(tmp_path / "kl_by_position.csv", index=False)
    out = tmp_path / "out"
    assert decay.main(["--kl-by-position", str(tmp_path / "kl_by_position.csv"), "--out",
                       str(out), "--study", str(tmp_path / "archive"), "--resamples",
                       "50"]) == 0
    for name in ("decay_models.csv", "decay_cells.csv", "decay_laws.csv", "decay.png",
                 "decay.md"):
        assert (out / name).stat().st_size > 0
    assert len(pd.read_csv(out / "decay_models.csv")) == 9
    assert set(pd.read_csv(out / "decay_laws.csv")["law"]) == {"exponent", "per_token",
                                                               "per_window"}
    # without --study the gone checkpoints have no config
    assert decay.main(["--kl-by-position", str(tmp_path / "kl_by_position.csv"), "--out",
                       str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err


def _run(tmp_path, table, capsys) -> tuple[int, str]:
    path = tmp_path / "in.csv"
    table.to_csv(path, index=False)
    code = decay.main(["--kl-by-position", str(path), "--out", str(tmp_path / "out"),
                       "--resamples", "20"])
    err = capsys.readouterr().err.strip()
    return code, err


def test_the_cli_refuses_bad_input(tmp_path, capsys):
    """A missing column, a cell without a usable distance: one line, exit 2. One window: the
    per-model and per-cell tables are written, the laws refused with exit 2."""
    table, _ = fabricate(tmp_path / "s", "per_token", windows=(8,), models=3)
    code, err = _run(tmp_path, table.drop(columns="bytes"), capsys)
    assert code == 2 and "bytes" in err and len(err.splitlines()) == 1
    flat = table.assign(kl_mean=np.where(table["checkpoint"].str.contains("seed"),
                                         1e-12, table["kl_mean"]))
    code, err = _run(tmp_path, flat, capsys)
    assert code == 2 and "L4_W8" in err and len(err.splitlines()) == 1
    code, err = _run(tmp_path, table, capsys)
    assert code == 2 and "two windows" in err and len(err.splitlines()) == 1
    assert len(pd.read_csv(tmp_path / "out" / "decay_models.csv")) == 3
    assert len(pd.read_csv(tmp_path / "out" / "decay_cells.csv")) == 1
    assert "need two windows" in (tmp_path / "out" / "decay.md").read_text()
