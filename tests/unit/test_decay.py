"""analysis.decay on fabricated kl_by_position tables: exponential decays with known tau, per
token or per window, read back through checkpoint configs written as training writes them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis import decay, decay_beside
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
        encoder_kv_groups=0 if encoder <= 2 else 1).to_dict()))
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
              rounding_every: int = 0, encoder: int = 2, scale: float = 1.0
              ) -> tuple[pd.DataFrame, dict]:
    """A kl_by_position table of `models` per W (one cell per W at L_d = layers and L_e =
    encoder: job L<layers>_W<W>, E<encoder>_L<layers>_W<W> for an encoder other than 2) whose
    tau is 3 bytes at every W (law per_token) or 0.4 W (per_window), times `scale`, each
    model's tau scattered by exp(N(0, spread)); and {checkpoint: its true tau}."""
    rng = np.random.default_rng(seed)
    parts, truth = [], {}
    for window in windows:
        job = f"L{layers}_W{window}" if encoder == 2 else f"E{encoder}_L{layers}_W{window}"
        for k in range(models):
            final = write_config(root, job, k, window, layers, encoder)
            tau = scale * (3.0 if law == "per_token" else 0.4 * window) * np.exp(
                rng.normal(0, spread))
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


def classes_for(checkpoints: dict, windows: dict, dppl: dict) -> pd.DataFrame:
    """A kl_by_class table (level model, group all, plus a class row and a pooled row that must
    be ignored): per checkpoint and replay form, dnll_mean = log(1 + the given change)."""
    rows = []
    for k, (checkpoint, job) in enumerate(checkpoints.items()):
        for form, multiple in (("W/2", 0.5), ("W", 1), ("2W", 2), ("4W", 4)):
            change = dppl[job][form] * (1 + 0.05 * (k % 3))     # models differ a little
            base = {"checkpoint": checkpoint, "job": job, "replay": form,
                    "N": int(multiple * windows[job]), "dnll_mean": np.log1p(change),
                    "kl_mean": 0.9 * change}
            rows += [{**base, "level": "model", "group": "all"},
                     {**base, "level": "model", "group": "identifier_far", "dnll_mean": 9.0},
                     {**base, "level": "seeds", "group": "all", "dnll_mean": 9.0}]
    return pd.DataFrame(rows)


def test_n_star_text_is_the_first_replay_within_the_bar_at_its_upper_bound():
    """A cell whose changes fall to 0.05% at 2W has N*_text = 2W; one whose 2W change is 0.09%
    with a wide spread over models fails there (upper bound above 0.1%) and passes at 4W; a cell
    of one model has no interval and no N*_text; a checkpoint missing from the decay fits is a
    ValueError naming --kl-by-class."""
    models = pd.DataFrame({"checkpoint": ["a0", "a1", "a2", "b0", "b1", "b2", "c0"],
                           "job": ["A"] * 3 + ["B"] * 3 + ["C"]})
    windows = {"A": 8, "B": 16, "C": 8}
    tight = {"W/2": 0.05, "W": 0.01, "2W": 0.0005, "4W": 1e-6}
    dppl = {"A": tight, "C": tight, "B": {**tight, "2W": 0.0009}}
    classes = classes_for(dict(zip(models["checkpoint"], models["job"])), windows, dppl)
    # spread B's three models at 2W: 0.0003, 0.0009, 0.0015 (mean 0.0009, upper bound > 0.001)
    for checkpoint, change in (("b0", 0.0003), ("b1", 0.0009), ("b2", 0.0015)):
        classes.loc[(classes["checkpoint"] == checkpoint) & (classes["replay"] == "2W"),
                    "dnll_mean"] = np.log1p(change)
    read = classes[(classes["level"] == "model") & (classes["group"] == "all")]
    replays = decay.replay_table(read, models)
    b = replays[(replays["job"] == "B") & (replays["replay"] == "2W")].iloc[0]
    assert b["dppl_mean"] == pytest.approx(0.0009, rel=1e-9)
    assert b["dppl_t_low"] < 0.0009 < 0.001 < b["dppl_t_high"] and not b["within_bar"]
    found = decay.n_star_text(replays)
    assert found["A"] == 16 and found["B"] == 64 and np.isnan(found["C"])
    # each model's own point reading: b2's 0.15% at 2W is over the bar, b0's 0.03% under it;
    # C's one model has a point reading though its cell has no interval
    points = decay.model_n_star(read)
    assert points["b0"] == 32 and points["b2"] == 64 and points["c0"] == 16
    assert np.isnan(decay.model_n_star(read, bar=1e-9)).all()
    with pytest.raises(ValueError, match="--kl-by-class"):
        decay.replay_table(read, models[models["checkpoint"] != "a1"])


def test_the_extrapolation_follows_each_law():
    """Per model the excess over W is tau ln(A / bar) (0 where A is below the bar); per token
    N = W' + the mean excess over cells, per window N = W' (1 + the mean excess in windows);
    a model without a fit is left out; the intervals hold the estimates."""
    bar = 0.001
    models = pd.DataFrame({"job": ["W8"] * 3 + ["W32"] * 3,
                           "W": [8] * 3 + [32] * 3,
                           "tau": [1.0, 1.5, np.nan, 4.0, 5.0, 6.0],
                           "A": [0.02, 0.03, 0.02, 0.05, 0.0005, 0.04]})
    excess = decay.excess_over_window(models, bar)
    assert excess[0] == pytest.approx(np.log(20)) and excess[1] == pytest.approx(1.5 * np.log(30))
    assert np.isnan(excess[2]) and excess[4] == 0.0
    got = decay.extrapolate(models, window=128, bar=bar, resamples=300).set_index("law")
    cell8, cell32 = excess[:2].mean(), excess[3:].mean()
    assert got.loc["per_token", "N"] == pytest.approx(128 + (cell8 + cell32) / 2)
    assert got.loc["per_window", "N"] == pytest.approx(128 * (1 + (cell8 / 8 + cell32 / 32) / 2))
    assert got.loc["per_window", "N"] > got.loc["per_token", "N"]
    assert (got["models"] == 5).all() and (got["cells"] == 2).all()
    for law in got.itertuples():
        assert law.N_ci_low <= law.N <= law.N_ci_high
    with pytest.raises(ValueError, match="no model"):
        decay.extrapolate(models.assign(tau=np.nan))


def one_reading(tmp_path, windows) -> None:
    """pos.csv and cls.csv in tmp_path: a per-window reading of three models a W whose change
    of perplexity is 1% at W and 0.05% at 2W (N*_text = 2W in every cell)."""
    table, _ = fabricate(tmp_path / "s", "per_window", windows=windows, models=3)
    table.to_csv(tmp_path / "pos.csv", index=False)
    cells = {c: c.split("/runs/")[1].split("/")[0] for c in table["checkpoint"].unique()}
    jobs = {job: int(job.split("_W")[1]) for job in cells.values()}
    tight = {"W/2": 0.05, "W": 0.01, "2W": 0.0005, "4W": 1e-6}
    classes_for(cells, jobs, {job: tight for job in jobs}).to_csv(tmp_path / "cls.csv",
                                                                  index=False)


def test_the_cli_writes_n_star_text_beside_the_fits(tmp_path):
    """With --kl-by-class the replay table, the extrapolation to --to-window and N*_text per
    cell are written; a --bar outside (0, 1) is refused with exit 2."""
    one_reading(tmp_path, (8, 16, 32))
    out = tmp_path / "out"
    args = ["--kl-by-position", str(tmp_path / "pos.csv"), "--out", str(out), "--kl-by-class",
            str(tmp_path / "cls.csv"), "--to-window", "64", "--resamples", "30"]
    assert decay.main(args) == 0
    got = pd.read_csv(out / "decay_cells.csv").set_index("job")
    assert (got["n_star_text_over_W"] == 2).all()
    fitted = pd.read_csv(out / "decay_models.csv")
    assert (fitted["n_star_point"] == 2 * fitted["W"]).all()       # each model's own reading
    assert set(pd.read_csv(out / "decay_extrapolation.csv")["window"]) == {64}
    assert len(pd.read_csv(out / "decay_replays.csv")) == 3 * 4
    assert "N*_text extrapolated to W = 64" in (out / "decay.md").read_text()
    assert decay.main([*args, "--bar", "2"]) == 2
    # the figure's third panel: per cell the change against N / W, its t-bounds and the bar
    table = pd.read_csv(tmp_path / "pos.csv")
    fig = decay.figure(table, decay.fit_models(table, None), None, decay.FLOOR,
                       (pd.read_csv(out / "decay_replays.csv"), got.reset_index(), 0.001))
    replay_axis = fig.axes[2]
    assert len(fig.axes) == 3 and replay_axis.get_xlabel() == "replay N / W"
    assert len(replay_axis.get_lines()) == 2 * 3 + 1     # mean and bound per cell, the bar


def test_two_studies_read_as_one(tmp_path):
    """Readings of two studies (their checkpoints gone: geometry from each study's runs/) fit
    as one: the cells of both in decay_cells.csv and N*_text from both kl_by_class.csv; the
    same run label in both studies, or a model in both class tables, is refused (exit 2)."""
    tables, class_files = [], []
    for name, windows in (("a", (8,)), ("b", (16,))):
        table, _ = fabricate(tmp_path / name, "per_window", windows=windows, models=3)
        cells = {c: c.split("/runs/")[1].split("/")[0] for c in table["checkpoint"].unique()}
        tight = {"W/2": 0.05, "W": 0.01, "2W": 0.0005, "4W": 1e-6}
        classes_for(cells, {job: windows[0] for job in cells.values()},
                    {job: tight for job in cells.values()}).to_csv(tmp_path / f"{name}.csv",
                                                                   index=False)
        # the checkpoints are gone: the geometry comes from the study's archive
        (tmp_path / f"{name}_archive").mkdir()
        (tmp_path / name / "runs").rename(tmp_path / f"{name}_archive" / "runs")
        table.to_csv(tmp_path / f"{name}_pos.csv", index=False)
        tables.append(str(tmp_path / f"{name}_pos.csv"))
        class_files.append(str(tmp_path / f"{name}.csv"))
    out = tmp_path / "out"
    args = ["--kl-by-position", *tables, "--out", str(out), "--resamples", "30",
            "--kl-by-class", *class_files, "--study", str(tmp_path / "a_archive"),
            str(tmp_path / "b_archive")]
    assert decay.main(args) == 0
    cells = pd.read_csv(out / "decay_cells.csv").set_index("job")
    assert sorted(cells.index) == ["L4_W16", "L4_W8"] and (cells["n_star_text_over_W"] == 2).all()
    assert decay.main([*args[:-1], str(tmp_path / "a_archive")]) == 2      # a study twice
    assert decay.main([*args[:8], class_files[0], class_files[0], *args[10:]]) == 2


def test_the_synthetic_suite_is_put_beside_the_cells_of_its_geometry(tmp_path):
    """--synthetic puts each synthetic job beside the real-text cells of the same W, L_d and L_e
    (from the synthetic study's configs, not its name): its N* per model as min, median, max
    (a model without a competent bin left out) and over W, beside the cell's N*_text; a job of
    another encoder depth matches no cell. Refused (exit 2): without --kl-by-class, without
    --synthetic-study, a synthetic model with no run there, a table without N_star."""
    one_reading(tmp_path, (8, 16))
    synthetic = tmp_path / "syn"
    rows = []
    for job, window, encoder, n_stars in (("S_W8", 8, 2, [16, 8, np.nan]),
                                          ("S_W16", 16, 2, [40, 48]),
                                          ("S_E4", 8, 4, [12, 12])):
        for seed, n_star in enumerate(n_stars):
            write_config(synthetic, job, seed, window, 4, encoder)
            rows.append({"job": job, "seed": seed, "W": window, "N_star": n_star,
                         "largest_competent_d": 24, "horizon": 3 * window})
    pd.DataFrame(rows).to_csv(tmp_path / "models.csv", index=False)
    out = tmp_path / "out"
    base = ["--kl-by-position", str(tmp_path / "pos.csv"), "--out", str(out), "--resamples",
            "30"]
    beside = ["--synthetic", str(tmp_path / "models.csv"), "--synthetic-study", str(synthetic)]
    assert decay.main([*base, "--kl-by-class", str(tmp_path / "cls.csv"), *beside]) == 0
    got = pd.read_csv(out / "decay_synthetic.csv").set_index("synthetic_job")
    assert sorted(got.index) == ["S_W16", "S_W8"]
    assert got.loc["S_W8", "cell"] == "L4_W8" and got.loc["S_W16", "cell"] == "L4_W16"
    assert list(got.loc["S_W8", ["synthetic_n_star_min", "synthetic_n_star_median",
                                 "synthetic_n_star_max"]]) == [8, 12, 16]
    assert got.loc["S_W8", "synthetic_models"] == 3
    assert got.loc["S_W16", "synthetic_n_star_over_W"] == pytest.approx(44 / 16)
    assert (got["n_star_text_over_W"] == 2).all()
    assert "synthetic suite's N* beside N*_text" in (out / "decay.md").read_text()
    assert decay.main([*base, *beside]) == 2                                # no --kl-by-class
    classes = ["--kl-by-class", str(tmp_path / "cls.csv")]
    assert decay.main([*base, *classes, *beside[:2]]) == 2                  # no study
    pd.DataFrame([*rows, {**rows[0], "seed": 7, "job": "S_gone"}]).to_csv(
        tmp_path / "gone.csv", index=False)
    assert decay.main([*base, *classes, "--synthetic", str(tmp_path / "gone.csv"),
                       *beside[2:]]) == 2
    pd.DataFrame(rows).drop(columns="N_star").to_csv(tmp_path / "bad.csv", index=False)
    assert decay.main([*base, *classes, "--synthetic", str(tmp_path / "bad.csv"),
                       *beside[2:]]) == 2


def test_fit_until_reads_the_near_range_of_a_decay_that_steepens(tmp_path):
    """A KL whose decay length is 0.4 W up to 2W and 0.2 W past it: the whole-range fit lands
    between the two, --fit-until 2 recovers the near one (0.4 W, within 1%), and a
    --fit-until at or below 1 is refused (exit 2)."""
    rows, window, r_exact = [], 16, 61
    final = write_config(tmp_path / "s", "L4_W16", 0, window, 4)
    d = np.arange(1, r_exact + window)
    near, far = 0.4 * window, 0.2 * window
    log_kl = np.where(d < 2 * window, -(d - window) / near,
                      -window / near - (d - 2 * window) / far) + np.log(0.05)
    kl = np.where(d < window, BEFORE_W, np.exp(log_kl))
    kl[d >= r_exact] = FROM_R_EXACT
    table = pd.DataFrame({"checkpoint": str(final), "distance": d, "bytes": 10_000,
                          "kl_mean": kl})
    whole = decay.fit_models(table, None)["tau"].iloc[0]
    first = decay.fit_models(table, None, until=2)["tau"].iloc[0]
    assert far < whole < near and first == pytest.approx(near, rel=0.01)
    table.to_csv(tmp_path / "pos.csv", index=False)
    args = ["--kl-by-position", str(tmp_path / "pos.csv"), "--out", str(tmp_path / "out")]
    assert decay.main([*args, "--fit-until", "2"]) == 2      # one W: the laws are refused
    fitted = pd.read_csv(tmp_path / "out" / "decay_models.csv")
    assert fitted["tau"].iloc[0] == pytest.approx(near, rel=0.01)
    assert "d < 2 W" in (tmp_path / "out" / "decay.md").read_text()
    assert decay.main([*args, "--fit-until", "1"]) == 2


def test_a_synthetic_model_without_its_run_is_refused_before_anything_is_written(tmp_path):
    """Every seed of a synthetic job must have its run (not only the first); a refusal leaves
    --out as it was; no matching job still writes a table with its columns."""
    one_reading(tmp_path, (8, 16))
    synthetic = tmp_path / "syn"
    write_config(synthetic, "S_W8", 0, 8, 4)
    rows = [{"job": "S_W8", "seed": seed, "W": 8, "N_star": 16, "largest_competent_d": 24,
             "horizon": 24} for seed in (0, 99)]
    pd.DataFrame(rows).to_csv(tmp_path / "models.csv", index=False)
    out = tmp_path / "out"
    args = ["--kl-by-position", str(tmp_path / "pos.csv"), "--out", str(out), "--resamples",
            "30", "--kl-by-class", str(tmp_path / "cls.csv"), "--synthetic-study",
            str(synthetic), "--synthetic"]
    assert decay.main([*args, str(tmp_path / "models.csv")]) == 2
    assert not out.exists()
    pd.DataFrame([{**rows[0], "W": 32}]).assign(job="S_W32").to_csv(tmp_path / "none.csv",
                                                                    index=False)
    write_config(synthetic, "S_W32", 0, 32, 4)
    assert decay.main([*args, str(tmp_path / "none.csv")]) == 0
    table = pd.read_csv(out / "decay_synthetic.csv")
    assert table.empty and list(table.columns) == decay_beside.SYNTHETIC_COLUMNS
    assert decay.main([*args[:-5], "--fit-until", "nan"]) == 2


def test_the_laws_are_fitted_at_each_depth_alone(tmp_path):
    """Cells of another depth (L_d = 8, one window, tau 3x as long) beside three windows at
    L_d = 4 leave the L_d = 4 laws exactly as fitted alone (pooled, beta would move), are
    named as not compared (one window), and get their own extrapolation row."""
    four, _ = fabricate(tmp_path / "a", "per_window", models=3)
    eight, _ = fabricate(tmp_path / "b", "per_window", windows=(8,), layers=8, models=3,
                         scale=3.0)
    alone = decay.compare_laws(decay.law_frame(decay.fit_models(four, None)), 50)[0]
    both = decay.fit_models(pd.concat([four, eight], ignore_index=True), None)
    laws, why = decay.law_table(both, 50)
    assert set(zip(laws["L_d"], laws["L_e"])) == {(4, 2)} and len(why) == 1
    assert "L_d = 8, L_e = 2" in why[0] and "two windows" in why[0]
    got = laws.set_index("law").loc["exponent", "estimate"]
    assert got == pytest.approx(alone.set_index("law").loc["exponent", "estimate"], rel=1e-12)
    pooled = decay.exponent(decay.law_frame(both))
    assert abs(pooled - got) > 0.1
    extrapolated = decay.extrapolate_depths(both, resamples=50)
    assert sorted(set(zip(extrapolated["L_d"], extrapolated["law"]))) == [
        (4, "per_token"), (4, "per_window"), (8, "per_token"), (8, "per_window")]
    for l_d in (4, 8):       # each depth's rows are its models' extrapolation alone
        alone = decay.extrapolate(both[both["L_d"] == l_d], resamples=50)
        rows = extrapolated[extrapolated["L_d"] == l_d].reset_index(drop=True)
        assert rows["N"].to_numpy() == pytest.approx(alone["N"].to_numpy(), rel=1e-12)
    assert (extrapolated[extrapolated["L_d"] == 8]["cells"] == 1).all()
    unfitted = both.assign(tau=np.where(both["L_d"] == 8, np.nan, both["tau"]))
    with pytest.raises(ValueError, match="L_d = 8, L_e = 2: no model with a decay fit"):
        decay.extrapolate_depths(unfitted, resamples=50)
    only_eight, why = decay.law_table(decay.fit_models(eight, None), 50)
    assert only_eight is None and len(why) == 1
    # laws at two depths: the figure draws each depth's fits
    sixteen, _ = fabricate(tmp_path / "c", "per_window", windows=(8, 16), layers=8, models=3)
    two = decay.fit_models(pd.concat([four, sixteen], ignore_index=True), None)
    laws, why = decay.law_table(two, 50)
    assert set(laws["L_d"]) == {4, 8} and not why
    labels = [line.get_label() for line in decay.figure(four, two, laws, decay.FLOOR)
              .axes[1].get_lines()]
    assert sum("per window" in label for label in labels) == 2


def test_depths_of_one_window_each_are_refused_though_their_windows_differ(tmp_path, capsys):
    """L_d = 4 at W = 8 and L_d = 8 at W = 16: two windows, but none at one depth, so no law
    (exit 2, both depths named)."""
    four, _ = fabricate(tmp_path / "a", "per_window", windows=(8,), models=3)
    eight, _ = fabricate(tmp_path / "b", "per_window", windows=(16,), layers=8, models=3)
    code, err = _run(tmp_path, pd.concat([four, eight], ignore_index=True), capsys)
    assert code == 2 and "L_d = 4" in err and "L_d = 8" in err


def test_the_encoders_effect_pairs_cells_of_one_w_and_decoder_depth(tmp_path):
    """Cells at W = 8 and L_d = 4 with encoders of 2 and 4 layers form one pair (the shallower
    as base), read at N = W: the ratios of the cells' mean KL and change of perplexity, their
    bootstrap intervals around them, each side's t-interval; cells without a partner (W = 16,
    or another decoder depth) form none. Through the CLI: decay_encoder.csv and its section."""
    base, _ = fabricate(tmp_path / "a", "per_window", windows=(8, 16), models=3)
    deep, _ = fabricate(tmp_path / "b", "per_window", windows=(8,), models=3, encoder=4)
    other, _ = fabricate(tmp_path / "c", "per_window", windows=(8,), layers=8, models=3)
    table = pd.concat([base, deep, other], ignore_index=True)
    table.to_csv(tmp_path / "pos.csv", index=False)
    cells = {c: c.split("/runs/")[1].split("/")[0] for c in table["checkpoint"].unique()}
    windows = {job: int(job.split("_W")[1]) for job in cells.values()}
    at_w = {"L4_W8": 0.01, "L4_W16": 0.01, "E4_L4_W8": 0.004, "L8_W8": 0.03}
    classes = classes_for(cells, windows, {job: {"W/2": 0.05, "W": v, "2W": 0.0005, "4W": 1e-6}
                                           for job, v in at_w.items()})
    classes.to_csv(tmp_path / "cls.csv", index=False)
    models = decay.fit_models(table, None)
    read = classes[(classes["level"] == "model") & (classes["group"] == "all")]
    pairs = decay_beside.encoder_effect(read, models, "W", resamples=300)
    assert len(pairs) == 1
    pair = pairs.iloc[0]
    assert (pair["base"], pair["base_L_e"], pair["deeper"], pair["deeper_L_e"]) == (
        "L4_W8", 2, "E4_L4_W8", 4)
    at = read[read["replay"] == "W"].assign(job=lambda t: t["checkpoint"].map(cells))
    kl = at.groupby("job")["kl_mean"].mean()
    assert pair["kl_ratio"] == pytest.approx(kl["E4_L4_W8"] / kl["L4_W8"], rel=1e-12)
    assert pair["dppl_ratio"] == pytest.approx(0.4, rel=0.1)
    for name in ("kl_ratio", "dppl_ratio"):
        assert pair[f"{name}_ci_low"] <= pair[name] <= pair[f"{name}_ci_high"]
    for side in ("base", "deeper"):
        assert pair[f"{side}_models"] == 3
        assert pair[f"{side}_kl_t_low"] < pair[f"{side}_kl"] < pair[f"{side}_kl_t_high"]
    # the interval draws both cells: with either cell's spread removed it narrows (in log
    # ratio, which the flattened cell's level does not scale)
    def log_width(row):
        return np.log(row["kl_ratio_ci_high"] / row["kl_ratio_ci_low"])
    for job in ("L4_W8", "E4_L4_W8"):
        flat = read.assign(kl_mean=np.where(read["checkpoint"].map(cells) == job, 0.009,
                                            read["kl_mean"]))
        narrow = decay_beside.encoder_effect(flat, models, "W", resamples=300).iloc[0]
        assert log_width(narrow) < log_width(pair), job
    # a cell with one model read at N = W: its mean and the ratio, no interval
    one = read[~((read["checkpoint"].map(cells) == "E4_L4_W8") & (read["replay"] == "W")
                 & ~read["checkpoint"].str.contains("seed0"))]
    single = decay_beside.encoder_effect(one, models, "W", resamples=300).iloc[0]
    assert single["deeper_models"] == 1 and np.isfinite(single["kl_ratio"])
    assert np.isnan(single["kl_ratio_ci_low"]) and np.isnan(single["deeper_kl_t_low"])
    out = tmp_path / "out"
    assert decay.main(["--kl-by-position", str(tmp_path / "pos.csv"), "--out", str(out),
                       "--kl-by-class", str(tmp_path / "cls.csv"), "--resamples", "30"]) == 0
    written = pd.read_csv(out / "decay_encoder.csv")
    assert list(written.columns) == decay_beside.ENCODER_COLUMNS and len(written) == 1
    md = (out / "decay.md").read_text()
    assert "The encoder's effect" in md and "Not compared at L_d = 4, L_e = 4" in md
