"""The seed-pooled statistics of a finished study, as tables: what `analysis.findings` writes
(and `analysis.report`, `analysis.depth`, `analysis.reach`, `analysis.real_text` read). Each
table function takes the per-example suite results (`load_results`) or the study directory and
returns a DataFrame; the columns are described in analysis/findings.py's module docstring.

Pooling over seeds pairs examples within a seed (the same document under `full` and under the
mode, on the same checkpoint); the seeds' checkpoints differ, so the pooled test asks whether
the recipe, not one checkpoint, loses accuracy at N.

Two levels of confidence interval. The example-level CI (`ci_low`, `ci_high`) treats every
example as independent, which holds within one checkpoint but not across them: the trained
model is the unit of replication. The seed-level CI (`seed_ci_low`, `seed_ci_high`) is a
bootstrap over seeds and examples: crossed where every model read the same documents (models
and documents drawn independently, `evals.suites.stats.crossed_bootstrap`), nested otherwise
(seeds, then each drawn seed's examples, `hierarchical_bootstrap`); `seed_ci_method` says
which. `seed_p` is the two-sided p of a t test over the seeds' own differences. With 3 seeds the bootstrap has only 10 distinct seed draws and is
narrow; read `seed_p` beside it. `seeds` says how many trained models a row rests on. A claim
that only the example-level CI supports is a claim about those checkpoints, not the recipe.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from ced.records import DamagedRecord, read_json
from ced.run_id import identified
from ced.tracking import job_and_seed
from evals.modes import (mode_from_columns, mode_sort_keys, named_mode, promises_exact,
                         with_mode_columns)
from evals.suites.stats import (binomial_two_sided, crossed_bootstrap, hierarchical_bootstrap,
                                holm, percentile_interval, seed_t_test, wilson_interval)

from . import per_model
from .per_model import by_job, replay_length_by_job
from .archive import CELLS, OUTCOMES, expand_cells

FULL = "full"


COMPETENT = 0.9            # `full` accuracy from which a family's drop is read as a finding


Z95 = 1.959963984540054


BOOTSTRAP_RESAMPLES = 2000


def paired_difference(b: int, c: int, n: int) -> tuple[float, float, float]:
    """Difference of two paired proportions, mode - full = (c - b) / n, with the Agresti-Min
    95% interval: the Wald interval of the 2x2 table with 0.5 added to each of its four cells
    (good coverage down to b = c = 0, unlike the plain Wald). b: full right and mode wrong;
    c: mode right and full wrong; n: pairs. Returns (difference, low, high)."""
    if n <= 0:
        return math.nan, math.nan, math.nan
    bb, cc, nn = b + 0.5, c + 0.5, n + 2.0
    d = (cc - bb) / nn
    se = math.sqrt(max((bb + cc) - (cc - bb) ** 2 / nn, 0.0)) / nn
    return (c - b) / n, max(-1.0, d - Z95 * se), min(1.0, d + Z95 * se)


def load_results(study: Path) -> pd.DataFrame:
    """Every suite results.csv of the study, with columns job, seed (training seed) and run;
    a model archived by `analysis.archive` is read from its per-example outcomes.csv.gz, or (an
    older archive) its cells.csv expanded into paired examples with the same counts."""
    frames = []
    for run_id, folder in identified(study / "suite"):
        path = next((folder / name for name in ("results.csv", OUTCOMES, CELLS)
                     if (folder / name).exists()), None)
        if path is None:
            continue
        if path.name == CELLS:
            frame = expand_cells(pd.read_csv(path, dtype={"x": str}))
        else:
            frame = pd.read_csv(path, dtype={"x": str, "target": str, "prediction": str},
                                low_memory=False)
        frames.append(frame.assign(job=run_id.group, base_job=run_id.job,
                                   train_seed=run_id.seed, run=run_id.label))
    if not frames:
        raise FileNotFoundError(f"{study}/suite: no <job>/seed<k>/results.csv (run the study's "
                                f"suite step first)")
    results = pd.concat(frames, ignore_index=True)
    results["correct"] = results["correct"].astype(bool)
    return results


def trained_jobs(results: pd.DataFrame) -> list[str]:
    """The jobs of `load_results` read as trained (not under an evaluation-time override)."""
    return list(results.loc[results["job"] == results["base_job"], "job"].unique())


def _with_pooled_x(results: pd.DataFrame) -> pd.DataFrame:
    """The results once per x and once more with x = "all" (pooled over the family's x)."""
    return pd.concat([results, results.assign(x="all")], ignore_index=True)


def _x_order(x: str) -> tuple:
    return (1, 0.0) if x == "all" else (0, float(x)) if re.fullmatch(r"-?\d+(\.\d+)?", x) \
        else (0, math.inf)


def accuracy_table(results: pd.DataFrame) -> pd.DataFrame:
    """Accuracy per job x family x x x mode, pooled over seeds (Wilson CI) and per seed."""
    rows = []
    keys = ["job", "family", "x", "mode"]
    for key, part in _with_pooled_x(results).groupby(keys, sort=False):
        per_seed = part.groupby("train_seed")["correct"].mean()
        correct, n = int(part["correct"].sum()), len(part)
        low, high = wilson_interval(correct, n)
        rows.append({**dict(zip(keys, key)), "n": n,
                     "accuracy": correct / n, "ci_low": low, "ci_high": high,
                     **_seed_level_mean(part, "correct", BOOTSTRAP_RESAMPLES),
                     "seed_mean": per_seed.mean(), "seed_min": per_seed.min(),
                     "seed_max": per_seed.max(),
                     "per_seed": " ".join(f"{v:.3f}" for v in per_seed.values)})
    return _sorted(pd.DataFrame(rows))


def _sorted(table: pd.DataFrame, keys: tuple = ("job", "family", "x")) -> pd.DataFrame:
    """Rows by job, family, x (numeric, `all` last) and mode (`evals.modes.mode_sort_keys`)."""
    if table.empty:
        return table
    mode_keys = mode_sort_keys(table)
    order = {"x": lambda c: c.map(_x_order), "mode": lambda c: mode_keys}
    return table.sort_values([*keys, "mode"], kind="stable",
                             key=lambda c: order[c.name](c) if c.name in order else c
                             ).reset_index(drop=True)


def _discordant(part: pd.DataFrame) -> tuple[int, int, int]:
    """(b, c, n) of a mode against full over the examples of `part` (both modes present)."""
    wide = part.pivot_table(index=["run", "id"], columns="mode", values="correct",
                            aggfunc="first")
    wide = wide.dropna()
    full, other = wide.iloc[:, 0].astype(bool), wide.iloc[:, 1].astype(bool)
    return int((full & ~other).sum()), int((other & ~full).sum()), len(wide)


def capability_drop_table(results: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Every mode against full, paired on examples and pooled over seeds (see module doc)."""
    rows = []
    pooled = _with_pooled_x(results)
    for (job, family, x), part in pooled.groupby(["job", "family", "x"], sort=False):
        every_full = part[part["mode"] == FULL]
        if every_full.empty:
            continue
        for mode in [m for m in part["mode"].unique() if m != FULL]:
            # the models read under `mode`: one read at full only (an unfinished study) is
            # no pair, and its full answers would move acc_full away from the pairs'
            full = every_full[every_full["run"].isin(part.loc[part["mode"] == mode, "run"])]
            pair = pd.concat([full.assign(mode="0full"),
                              part[part["mode"] == mode].assign(mode="1mode")])
            b, c, n = _discordant(pair)
            diff, low, high = paired_difference(b, c, n)
            wide = pair.pivot_table(index=["train_seed", "id"], columns="mode",
                                    values="correct", aggfunc="first").dropna()
            diffs = wide["1mode"].astype(int) - wide["0full"].astype(int)
            seeds = []
            for seed, seed_part in pair.groupby("train_seed"):
                sb, sc, sn = _discordant(seed_part)
                seeds.append((seed, (sc - sb) / sn if sn else math.nan,
                              binomial_two_sided(sb, sb + sc), (sb, sc, sn)))
            rows.append({"job": job, "family": family, "x": x, "mode": mode, "n": n,
                         "acc_full": full["correct"].mean(),
                         "acc_mode": part[part["mode"] == mode]["correct"].mean(),
                         "difference": diff, "ci_low": low, "ci_high": high,
                         "full_only": b, "mode_only": c, "p_value": binomial_two_sided(b, b + c),
                         **model_level_columns(diffs),
                         "per_seed_difference": " ".join(f"{s[1]:+.3f}" for s in seeds),
                         "per_seed_p": " ".join(f"{s[2]:.3g}" for s in seeds)})
    return _drop_table(rows, alpha)


def model_level_columns(diffs: pd.Series, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = 0) -> dict:
    """The model-level columns of a paired difference, from the per-example differences
    `diffs` (mode - full in {-1, 0, +1}, indexed by (train_seed, id)):
    - `seed_ci_low`/`seed_ci_high`: the 95% bootstrap CI of the mean over models of each
      model's difference. When every model read the same examples (same ids), models and
      examples are drawn crossed (`stats.crossed_bootstrap`: an example shared by all models
      is one draw); otherwise nested (models, then each drawn model's own examples;
      `stats.hierarchical_bootstrap`). `seed_ci_method` says which.
    - `seed_p`: the two-sided p of a t test over the models' differences (NaN with one).
    - `seeds`: how many trained models the row rests on."""
    groups = [g.to_numpy(dtype=float) for _, g in diffs.groupby(level=0) if len(g)]
    _, _, p = seed_t_test([g.mean() for g in groups])
    matrix = diffs.unstack(level=1) if len(groups) > 1 else None
    if matrix is not None and not matrix.isna().to_numpy().any():
        method = "crossed"
        replicates = crossed_bootstrap(matrix.to_numpy(dtype=float), resamples, seed)
    else:
        method = "nested"
        replicates = hierarchical_bootstrap(groups, resamples, seed)
    low, high = percentile_interval(replicates)
    return {"seeds": len(groups), "seed_ci_low": low, "seed_ci_high": high,
            "seed_ci_method": method, "seed_p": p}


def _drop_table(rows: list[dict], alpha: float) -> pd.DataFrame:
    """Paired-difference rows as a table with `p_holm` (Holm over the distances of one job x
    family x mode; the pooled x = "all" is its own test) and `significant` (a drop, p_holm <
    alpha), sorted."""
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["p_holm"] = table["p_value"]
    for _, part in table[table["x"] != "all"].groupby(["job", "family", "mode"]):
        table.loc[part.index, "p_holm"] = holm(part["p_value"].tolist())
    table["significant"] = (table["p_holm"] < alpha) & (table["difference"] < 0)
    return _sorted(table)


def reference_drop_table(results: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Runs with evaluation-time overrides (`<job>@topk=K`, `<job>@kv=SPEC`) against the
    unmodified model: every mode of the overridden run paired with the same job's `full` run
    without overrides on the same examples (same seed, same document), pooled over seeds;
    the columns of `capability_drop_table` plus `agree`, the share of examples whose
    prediction is unchanged. So `<job>@kv=X` `full` is the cost of the storage format alone,
    `replay=N` that of the format and bounded replay together (replay alone: the base job's
    own capability_drop rows). Empty when no run has an override."""
    if "base_job" not in results or (results["job"] == results["base_job"]).all():
        return pd.DataFrame()
    base = results[(results["job"] == results["base_job"]) & (results["mode"] == FULL)]
    base = base[["base_job", "train_seed", "family", "id", "correct", "prediction"]]
    rows = []
    varied = results[results["job"] != results["base_job"]]
    for (job, family, mode), cell in varied.groupby(["job", "family", "mode"], sort=False):
        pairs = cell.merge(base, on=["base_job", "train_seed", "family", "id"],
                           suffixes=("", "_ref"))
        for x, part in [*pairs.groupby("x", sort=False), ("all", pairs)]:
            mine, ref = part["correct"].astype(bool), part["correct_ref"].astype(bool)
            b, c, n = int((ref & ~mine).sum()), int((mine & ~ref).sum()), len(part)
            diff, low, high = paired_difference(b, c, n)
            diffs = (part["correct"].astype(int) - part["correct_ref"].astype(int)).set_axis(
                pd.MultiIndex.from_frame(part[["train_seed", "id"]]))
            seeds = []
            for _, seed_part in part.groupby("train_seed"):
                sm, sr = seed_part["correct"].astype(bool), seed_part["correct_ref"].astype(bool)
                sb, sc = int((sr & ~sm).sum()), int((sm & ~sr).sum())
                seeds.append(((sc - sb) / len(seed_part), binomial_two_sided(sb, sb + sc),
                              (sb, sc, len(seed_part))))
            rows.append({"job": job, "family": family, "x": str(x), "mode": mode, "n": n,
                         "acc_full": ref.mean() if n else math.nan,
                         "acc_mode": mine.mean() if n else math.nan, "difference": diff,
                         "ci_low": low, "ci_high": high, "full_only": b, "mode_only": c,
                         "p_value": binomial_two_sided(b, b + c),
                         **model_level_columns(diffs),
                         "agree": float((part["prediction"].astype(str)
                                         == part["prediction_ref"].astype(str)).mean())
                         if n else math.nan,
                         "per_seed_difference": " ".join(f"{d:+.3f}" for d, _, _ in seeds),
                         "per_seed_p": " ".join(f"{p:.3g}" for _, p, _ in seeds)})
    return _drop_table(rows, alpha)


def exact_mode_check(drops: pd.DataFrame, marks: dict) -> pd.DataFrame:
    """The rows of `drops` (pooled over x) whose mode the contract makes exact
    (`evals.modes.promises_exact`: N >= R_exact, or a multi-turn policy that rebuilds every
    state exactly) but that changed at least one answer against `full`: each is a bug, or
    float32 round-off at a near-tie that must be shown. Empty when every exact mode is exact
    (or R_exact is unknown)."""
    if drops.empty:
        return drops
    pooled = drops[drops["x"] == "all"]
    modes = with_mode_columns(pooled, by_job(pooled, marks, "R_exact"), by_job(pooled, marks, "W"))
    rows = []
    for (_, row), (_, columns) in zip(pooled.iterrows(), modes.iterrows()):
        r_exact = marks.get(row["job"], {}).get("R_exact")
        mode = mode_from_columns(columns, row["mode"])
        if mode is None:
            continue
        if r_exact and promises_exact(mode, int(r_exact)) and row["full_only"] + row["mode_only"]:
            rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def competence_table(accuracy: pd.DataFrame) -> pd.DataFrame:
    """`full` accuracy per job x family pooled over distances and seeds, and competence."""
    full = accuracy[(accuracy["mode"] == FULL) & (accuracy["x"] == "all")]
    table = full[["job", "family", "seeds", "n", "accuracy", "ci_low", "ci_high",
                  "seed_ci_low", "seed_ci_high", "per_seed"]].copy()
    table["competent"] = table["accuracy"] >= COMPETENT
    return table.reset_index(drop=True)


def divergence_table(study: Path, seed: int = 0, resamples: int = 2000) -> pd.DataFrame:
    """First-token KL and top-1 agreement per job x T x mode, pooled over seeds and prompts."""
    path = study / "divergence" / "divergence.parquet"
    if not path.exists():
        return pd.DataFrame()
    div = pd.read_parquet(path)
    div = div[(div["metric"].isin(["kl", "top1_agree"])) & (div["step"] == 0)].copy()
    # a checkpoint's job and seed read its run's record: once per checkpoint, not per row
    labels = div["checkpoint"].map({c: job_and_seed(c) for c in div["checkpoint"].unique()})
    div = div.assign(job=labels.map(lambda s: s[0]), train_seed=labels.map(lambda s: s[1]))
    rng = np.random.default_rng(seed)
    rows = []
    for (job, t, mode, metric), part in div.groupby(["job", "T", "mode", "metric"], sort=False):
        values = part["value"].to_numpy(dtype=float)
        boots = rng.choice(values, size=(resamples, len(values))).mean(axis=1)
        per_seed = part.groupby("train_seed")["value"].mean()
        rows.append({"job": job, "T": t, "mode": mode, "metric": metric, "n": len(values),
                     "mean": values.mean(), "ci_low": np.quantile(boots, 0.025),
                     "ci_high": np.quantile(boots, 0.975),
                     **_seed_level_mean(part, "value", resamples),
                     "per_seed": " ".join(f"{v:.3g}" for v in per_seed.values)})
    return _sorted(pd.DataFrame(rows), keys=("job", "T", "metric"))


def _seed_level_mean(part: pd.DataFrame, column: str, resamples: int) -> dict:
    """`seeds` and the hierarchical-bootstrap 95% CI (`seed_ci_low`, `seed_ci_high`) of the mean
    over seeds of each seed's mean of `column` (the model-level CI beside an example-level
    one)."""
    groups = [g[column].to_numpy(dtype=float) for _, g in part.groupby("train_seed")]
    low, high = percentile_interval(hierarchical_bootstrap(groups, resamples))
    return {"seeds": len(groups), "seed_ci_low": low, "seed_ci_high": high}


def answer_kl_table(results: pd.DataFrame, seed: int = 0,
                    resamples: int = 2000) -> pd.DataFrame:
    """KL(full || mode) at the answer (the suite's `kl_answer`: summed over the target's
    teacher-forced tokens) per job x family x mode, pooled over distances and seeds: mean with a
    bootstrap 95% CI over examples, and each seed's mean. Empty for results without the column
    (suites run before it existed)."""
    if "kl_answer" not in results:
        return pd.DataFrame()
    rng = np.random.default_rng(seed)
    rows = []
    for (job, family, mode), part in results[results["mode"] != FULL].groupby(
            ["job", "family", "mode"], sort=False):
        values = part["kl_answer"].to_numpy(dtype=float)
        boots = rng.choice(values, size=(resamples, len(values))).mean(axis=1)
        per_seed = part.groupby("train_seed")["kl_answer"].mean()
        rows.append({"job": job, "family": family, "mode": mode, "n": len(values),
                     "mean": values.mean(), "ci_low": np.quantile(boots, 0.025),
                     "ci_high": np.quantile(boots, 0.975),
                     **_seed_level_mean(part, "kl_answer", resamples),
                     "per_seed": " ".join(f"{v:.3g}" for v in per_seed.values)})
    return _sorted(pd.DataFrame(rows), keys=("job", "family"))


def needle_id_features(context: str, sep: str = ":") -> dict:
    """How close a needle document's distractor ids come to the queried one (the needle task's
    format, ced.data.tasks.needle: lines `id <id><sep><code>` and the query `?id <id><sep>` at
    the end): `shared_suffix`, the most trailing digits of the queried id that one other line's
    id shares (0 ... id_digits - 1); `one_digit_away`, whether some other id differs from it in
    exactly one digit; `codes`, the other lines' codes; `nearest_codes`, the codes of the
    lines that share the `shared_suffix` (none when it is 0)."""
    esc = re.escape(sep)
    query = re.search(rf"\?id (\d+){esc}$", context)
    if query is None:
        raise ValueError(f"not a needle document (no `?id <digits>{sep}` at its end): "
                         f"{context[-40:]!r}")
    ident = query.group(1)
    others = [(i, c) for i, c in re.findall(rf"id (\d+){esc}(\d+)\n", context[:query.start()])
              if i != ident]

    def suffix(other: str) -> int:
        n = 0
        while n < len(ident) and other[len(other) - 1 - n] == ident[len(ident) - 1 - n]:
            n += 1
        return n
    shared = max((suffix(i) for i, _ in others), default=0)
    return {"shared_suffix": shared,
            "one_digit_away": any(sum(a != b for a, b in zip(i, ident)) == 1 for i, _ in others),
            "codes": [c for _, c in others],
            "nearest_codes": [c for i, c in others if shared and suffix(i) == shared]}


def load_needle_documents(study: Path) -> pd.DataFrame:
    """run, id and needle_id_features of every needle document a study's suite evaluated."""
    rows = []
    for run_id, folder in identified(study / "suite"):
        path = folder / "data" / "needle.jsonl"
        if not path.exists():
            continue
        run = run_id.label
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            rows.append({"run": run, "id": doc["id"],
                         **needle_id_features(doc["context"], doc["params"].get("sep", ":"))})
    return pd.DataFrame(rows)


def needle_id_table(results: pd.DataFrame, documents: pd.DataFrame) -> pd.DataFrame:
    """`full` accuracy on the needle family by the nearest distractor id (see module doc):
    per job x slice, where slice is `shared_suffix=K`, `one_digit_away=True|False` or `all`,
    with columns n, accuracy, Wilson CI, per_seed accuracy, wrong (count) and three shares of
    the wrong answers: one_wrong_digit (exactly one wrong digit, right length),
    digit_from_nearest (that digit is, at its position, the digit of a line whose id shares
    the longest suffix with the needle's) and other_line_code (another line's whole code).
    Empty without needle results."""
    full = results[(results["family"] == "needle") & (results["mode"] == FULL)]
    if full.empty or documents.empty:
        return pd.DataFrame()
    full = full.merge(documents, on=["run", "id"], how="inner")
    target, prediction = full["target"].astype(str), full["prediction"].astype(str)
    one_wrong = [len(t) == len(p) and sum(a != b for a, b in zip(t, p)) == 1
                 for t, p in zip(target, prediction)]
    # the one wrong digit is the nearest line's digit at that position
    from_nearest = [ok and any(c[i] == p[i] for c in near for i in range(len(t)) if t[i] != p[i])
                    for ok, t, p, near in zip(one_wrong, target, prediction, full["nearest_codes"])]
    full = full.assign(one_wrong_digit=one_wrong, digit_from_nearest=from_nearest,
                       other_line_code=[p in codes for p, codes in zip(prediction, full["codes"])])
    rows = []
    slices = [("all", full)]
    slices += [(f"shared_suffix={k}", part) for k, part in full.groupby("shared_suffix")]
    slices += [(f"one_digit_away={k}", part) for k, part in full.groupby("one_digit_away")]
    for label, part in slices:
        for job, cell in part.groupby("job", sort=True):
            correct, n = int(cell["correct"].sum()), len(cell)
            low, high = wilson_interval(correct, n)
            wrong = cell[~cell["correct"]]
            per_seed = cell.groupby("train_seed")["correct"].mean()
            rows.append({"job": job, "slice": label, "n": n, "accuracy": correct / n,
                         "ci_low": low, "ci_high": high,
                         "per_seed": " ".join(f"{v:.3f}" for v in per_seed.values),
                         "wrong": len(wrong),
                         "one_wrong_digit": wrong["one_wrong_digit"].mean() if len(wrong)
                         else math.nan,
                         "digit_from_nearest": wrong["digit_from_nearest"].mean() if len(wrong)
                         else math.nan,
                         "other_line_code": wrong["other_line_code"].mean() if len(wrong)
                         else math.nan})
    return pd.DataFrame(rows).sort_values(["job"], kind="stable").reset_index(drop=True)


def geometry(study: Path) -> dict[str, dict]:
    """Per job: W and R_exact of its model (from a suite run's summary.json settings)."""
    out = {}
    for run_id, folder in identified(study / "suite"):
        path = folder / "summary.json"
        if not path.exists():
            continue
        try:
            record = read_json(path)
        except DamagedRecord as exc:
            print(f"[findings] warning: {exc}; its W and R_exact are read from another run "
                  "of the job, if any", file=sys.stderr)
            continue
        settings = record.get("run", {}).get("settings") or record.get("settings", {})
        out.setdefault(run_id.group,
                       {"W": settings.get("window"), "R_exact": settings.get("r_exact")})
    return out


def run_traits(study: Path) -> pd.DataFrame:
    """Per trained model (`runs/<job>/seed<k>/config.yaml`): job, seed, L_d (decoder layers),
    W, shift_tokens, the replay-simulation probability and length it was trained with, and
    `arm`: `sim` (replay simulation on) or `no_sim`, with `+shift<s>` when the model mixes input
    tokens. Empty when the study has no run configs."""
    rows = []
    for run_id, folder in identified(study / "runs"):
        path = folder / "config.yaml"
        if not path.exists():
            continue
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        model, replay = cfg.get("model", {}), cfg.get("train", {}).get("replay", {})
        probability = float(replay.get("probability") or 0.0)
        shift = int(model.get("shift_tokens") or 0)
        arm = ("sim" if probability > 0 else "no_sim") + (f"+shift{shift}" if shift else "")
        rows.append({"job": run_id.job, "seed": run_id.seed,
                     "L_d": model.get("n_decoder_layers"), "W": model.get("window"),
                     "shift_tokens": shift, "replay_probability": probability,
                     "replay_length": replay.get("length") if probability > 0 else None,
                     "arm": arm})
    return pd.DataFrame(rows)


def per_model_tables(results: pd.DataFrame, study: Path, marks: dict,
                     alpha: float = 0.05) -> dict[str, pd.DataFrame]:
    """The trained model as the unit (`analysis.per_model`): `model_drops` (per model x family x
    replay mode), `failure_rate` (per job x mode: models failed, Clopper-Pearson CI) and
    `n_star` (one row per model: job, arm, seed, L_d, W, R_exact, N*, the drop and failure at
    N = W). Empty tables when no mode has a replay length."""
    drops = per_model.model_drops(results, marks, alpha)
    if drops.empty:
        return {"model_drops": drops, "failure_rate": drops, "n_star": drops}
    star = per_model.n_star(drops, marks)
    traits = run_traits(study)
    if not traits.empty:
        star = star.merge(traits[["job", "seed", "arm", "L_d"]], on=["job", "seed"], how="left")
    else:
        star = star.assign(arm=None, L_d=None)
    first = ["job", "arm", "seed", "L_d", "W", "R_exact", "N_star", "drop_at_W", "failed_at_W"]
    star = star[first + [c for c in star.columns if c not in first]]
    return {"model_drops": drops, "failure_rate": per_model.failure_rates(drops),
            "n_star": star}


def replay_label(n: int | None) -> str | None:
    """The label of the single-turn replay of N = n (`evals.modes.named_mode`), to pick a
    table's rows at that N; None where n is not known."""
    return None if n is None else named_mode(replay=n).name


def with_replay_length(table: pd.DataFrame, marks: dict) -> pd.DataFrame:
    """`table` (with job and mode columns) plus N, the replay length of each row's mode."""
    if table.empty:
        return table.assign(N=[])
    return table.assign(N=replay_length_by_job(table, marks))


def seed_t_table(drops: pd.DataFrame) -> pd.DataFrame:
    """Seed-level columns for a drop table whose per-example results are gone (the older
    studies' outputs/ did not survive their machines): from `per_seed_difference` (each
    trained model's paired difference, as written: 3 decimals), the Student t 95% CI of their
    mean (`seed_t_low`, `seed_t_high`; df = seeds - 1) and its p (`seed_t_p`). With 3 models
    t(0.975, 2) = 4.30: this is the honest width of a 3-model claim. Seeds that all read
    0.000 (|difference| < 0.0005 each) give the zero-width interval [0, 0]. Where the
    per-example results exist, `model_level_columns` (the bootstrap over models and
    examples) is the better interval."""
    out = drops.copy()
    rows = []
    for text in out["per_seed_difference"]:
        values = [float(v) for v in text.split()] if isinstance(text, str) else []
        low, high, p = seed_t_test(values)
        rows.append({"seeds": len(values),
                     "seed_mean": sum(values) / len(values) if values else math.nan,
                     "seed_t_low": low, "seed_t_high": high, "seed_t_p": p})
    extra = pd.DataFrame(rows, index=out.index)
    for column in extra:
        out[column] = extra[column]
    return out


def write_seed_t(findings_dir: Path) -> dict[str, Path]:
    """`seed_level.csv` in a findings directory: every row of its capability_drop.csv (and
    override_drop.csv, with `table` saying which) with `seed_t_table`'s columns."""
    tables = []
    for name in ("capability_drop", "override_drop"):
        path = findings_dir / f"{name}.csv"
        if path.exists():
            table = pd.read_csv(path)
            if "per_seed_difference" in table and not table.empty:
                tables.append(seed_t_table(table).assign(table=name))
    if not tables:
        raise FileNotFoundError(f"{findings_dir}: no capability_drop.csv or override_drop.csv "
                                "with a per_seed_difference column")
    out = findings_dir / "seed_level.csv"
    pd.concat(tables, ignore_index=True).to_csv(out, index=False)
    return {"seed_level": out}


def add_pool_option(parser, where: str) -> None:
    """The `--pool CELL=A,B` option of an analysis that reads cells (`parse_pools` reads its
    items); `where`: where the pooled cell shows in that analysis's output."""
    parser.add_argument("--pool", nargs="*", default=[], metavar="CELL=A,B", help=(
        "jobs read as one cell's models (distinct seeds, the same W and R_exact, e.g. an fp32 "
        f"model joining a bf16 cell's other seeds), {where}"))


def parse_pools(items: list[str]) -> dict[str, list[str]]:
    """`--pool CELL=JOB_A,JOB_B` items -> {cell: [jobs]}: jobs read as one cell's models (a
    recipe trained in two precisions on different seeds). A malformed item, a cell named twice
    or a job in two cells is a ValueError naming it."""
    pools: dict[str, list[str]] = {}
    for item in items:
        cell, sep, jobs = item.partition("=")
        names = [j for j in jobs.split(",") if j]
        if not (sep and cell and len(names) >= 2):
            raise ValueError(f"--pool: expected CELL=JOB_A,JOB_B[,...], got {item!r}")
        if cell in pools:
            raise ValueError(f"--pool: cell {cell!r} named twice")
        pools[cell] = names
    jobs = [j for names in pools.values() for j in names]
    twice = sorted({j for j in jobs if jobs.count(j) > 1})
    if twice:
        raise ValueError(f"--pool: job(s) {twice} in more than one cell")
    return pools


def pooled(frame: pd.DataFrame, cell: str, jobs: list[str]) -> pd.DataFrame:
    """The rows of `jobs` in `frame` (columns job and seed) relabelled as one cell `cell`.
    Refused (ValueError) where a job is missing or a seed is in two of the jobs: a cell's
    models are distinct trainings, and a seed trained twice (an fp32 twin of a bf16 model) is
    one seed read twice, which pooling would count as two."""
    missing = sorted(set(jobs) - set(frame["job"]))
    if missing:
        raise ValueError(f"--pool {cell}: no job {missing} in the table (it has "
                         f"{sorted(set(frame['job']))})")
    mine = frame[frame["job"].isin(jobs)]
    owners = mine.groupby("seed")["job"].nunique()
    shared = sorted(int(s) for s in owners[owners > 1].index)
    if shared:
        raise ValueError(f"--pool {cell}: seed(s) {shared} in more than one of {jobs}: pool "
                         "models of distinct seeds (compare twins with --compare)")
    return mine.assign(job=cell)
