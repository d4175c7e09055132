"""Seed-pooled statistics of a finished study, for FINDINGS.md: `python -m evals.findings`.

    python -m evals.findings --study outputs/studies/replay_length --out findings/replay_length \
        [--compare sim_fixed_W:sim_uniform ...]

Reads what the study driver wrote (`suite/<job>/seed<k>[@topk=K][@kv=SPEC]/results.csv`: one row per
example and mode; `divergence/divergence.parquet`; `runs/<job>/seed<k>/final/config.json`) and
writes into --out:

  accuracy.csv          per job x family x x (distance, or `all` pooled over x) x mode: the
                        accuracy pooled over seeds with its Wilson 95% CI, its seed-level CI,
                        the mean over seeds and each seed's accuracy
  capability_drop.csv   every mode against `full` on the same examples, pooled over seeds: the
                        paired difference (mode - full) with its 95% CI (Agresti-Min: the
                        paired Wald interval with 0.5 added to each cell), the exact McNemar
                        p-value and its Holm correction over the x of one job x family x mode;
                        the seed-level CI and p (below); and each seed's difference and p-value
  competence.csv        per job x family: `full` accuracy pooled over seeds and distances, and
                        whether the exact model is competent (>= COMPETENT) there, so that a
                        drop is only read where there is something to lose
  divergence.csv        per job x T x mode: first-token KL(exact || mode) and top-1 agreement
                        at the cut of a validation prompt (evals.divergence), mean over prompts
                        and seeds with a bootstrap 95% CI over (seed, prompt), each seed's mean
  override_drop.csv     runs with evaluation-time overrides (`@topk=K`, `@kv=SPEC`), every
                        mode against the unmodified model's `full` on the same examples
                        (`reference_drop_table`); only when the study has such runs
  needle_ids.csv        needle family only: `full` accuracy by how far the needle's id is
                        from the nearest other line's (`shared_suffix`: the longest id suffix
                        another line shares; `one_digit_away`: whether a line's id differs in
                        one digit), pooled over seeds (Wilson CI) and per seed, and what the
                        wrong answers are (one wrong digit, taken from the nearest id's line,
                        another line's code)
  answer_kl.csv         per job x family x mode: KL(full || mode) at the suite's answers
                        (teacher-forced, summed over the answer's tokens), mean over examples
                        and seeds with a bootstrap 95% CI, each seed's mean
  accuracy_vs_N.png     accuracy against the replay length N per family, a line per job
                        (pooled over seeds and distances, band: min-max over seeds), W and
                        R_exact marked; `full` as a dashed level
  kl_vs_N.png           KL against N per job (at a prompt cut; at the answer, per family),
                        next to the accuracy drop of the same N (pooled over families the
                        exact model is competent in)
  model_drops.csv       the trained model as the unit (evals.per_model): per job x seed x
                        family x replay mode, the model's own paired drop, McNemar p, Holm over
                        the families it is competent in, and whether it fails
  failure_rate.csv      per job x replay mode: models that fail, with the exact Clopper-Pearson
                        95% CI of the rate
  n_star.csv            one row per model: job, arm, seed, L_d, W, R_exact, N* (the smallest N
                        from W to R_exact within 0.5 point and 0.01 nats on every competent
                        family), the drop and failure at N = W
  exact_violations.csv  modes that the contract makes exact (evals.modes.promises_exact) but
                        that changed answers against `full` (also printed as a warning); only
                        when there are any
  arms.csv              job against job (`evals.arms`): for every two jobs whose training
                        settings differ in one key (e.g. model.topk: 2 -> 4), and each
                        --compare FROM:TO pair, per family x mode x metric (accuracy, the drop
                        against full, answer KL) pooled over distances: both jobs' values, the
                        difference (to - from) with its example-level CI (paired by document
                        where both read the same documents) and its model-level CI, Welch's p
                        over the models, and the model counts; only when the study has such a
                        pair
  arms.png              the differences of arms.csv in accuracy and answer KL against N, with
                        the model-level CI
  provenance.json       the study's commands, git commits and step times (summary.json)
  findings.md           the tables above in Markdown, for FINDINGS.md, headed by the
                        provenance

A `real_text` study (real_text/ and no suite/) is published by `evals.real_text.publish`
instead: its tables and plots, training.csv and training_curves.png, provenance.json and
findings.md.

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

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from ced.records import DamagedRecord, read_json, write_json
from ced.writable import OutputDirError, check_output_dir
from evals import arms, per_model, plots, predictions
from evals.suites.stats import (binomial_two_sided, crossed_bootstrap, hierarchical_bootstrap,
                                holm, percentile_interval, seed_t_test, wilson_interval)

FULL = "full"
COMPETENT = 0.9            # `full` accuracy from which a family's drop is read as a finding
Z95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000
# `<job>/seed<k>` plus the evaluation-time overrides of the study driver: `@topk=K`, `@kv=SPEC`
_LABEL = re.compile(r"^(?P<job>[^/]+)/seed(?P<seed>\d+)(?P<variant>(?:@(?:topk|kv)=[^@/]+)*)$")


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
    a model archived by `evals.archive` is read from its per-example outcomes.csv.gz, or (an
    older archive) its cells.csv expanded into paired examples with the same counts."""
    from evals.archive import CELLS, OUTCOMES, expand_cells
    frames = []
    paths = {p.parent: p for p in (study / "suite").glob(f"*/seed*/{CELLS}")}
    paths.update({p.parent: p for p in (study / "suite").glob(f"*/seed*/{OUTCOMES}")})
    paths.update({p.parent: p for p in (study / "suite").glob("*/seed*/results.csv")})
    for path in sorted(paths.values()):
        label = f"{path.parent.parent.name}/{path.parent.name}"
        match = _LABEL.match(label)
        if match is None:
            continue
        if path.name == CELLS:
            frame = expand_cells(pd.read_csv(path, dtype={"x": str}))
        else:
            frame = pd.read_csv(path, dtype={"x": str, "target": str, "prediction": str},
                                low_memory=False)
        job = match["job"] + match["variant"]
        frames.append(frame.assign(job=job, base_job=match["job"], train_seed=int(match["seed"]),
                                   run=label))
    if not frames:
        raise FileNotFoundError(f"{study}/suite: no <job>/seed<k>/results.csv (run the study's "
                                f"suite step first)")
    results = pd.concat(frames, ignore_index=True)
    results["correct"] = results["correct"].astype(bool)
    return results


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


def _mode_order(mode: str) -> tuple:
    """full, then replay=N by N, then replay=exact, then the rest by name."""
    match = re.fullmatch(r"replay=(\d+)", mode)
    if mode == FULL:
        return (0, 0, "")
    if match:
        return (1, int(match.group(1)), "")
    return (2, 0, "") if mode == "replay=exact" else (3, 0, mode)


def _sorted(table: pd.DataFrame, keys: tuple = ("job", "family", "x")) -> pd.DataFrame:
    """Rows by job, family, x (numeric, `all` last) and mode (`_mode_order`)."""
    if table.empty:
        return table
    order = {"x": lambda c: c.map(_x_order), "mode": lambda c: c.map(_mode_order)}
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
        full = part[part["mode"] == FULL]
        if full.empty:
            continue
        for mode in [m for m in part["mode"].unique() if m != FULL]:
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
    from evals.modes import parse_mode, promises_exact
    if drops.empty:
        return drops
    rows = []
    for _, row in drops[drops["x"] == "all"].iterrows():
        r_exact = marks.get(row["job"], {}).get("R_exact")
        try:
            mode = parse_mode(row["mode"])
        except ValueError:
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
    labels = div["checkpoint"].map(_checkpoint_label)
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


def _load_needle_documents(study: Path) -> pd.DataFrame:
    """run, id and needle_id_features of every needle document a study's suite evaluated."""
    rows = []
    for path in sorted((study / "suite").glob("*/seed*/data/needle.jsonl")):
        run = f"{path.parent.parent.parent.name}/{path.parent.parent.name}"
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


def _checkpoint_label(path: str) -> tuple[str, int | None]:
    """(job, training seed) of a checkpoint path `.../runs/<job>/seed<k>/final`."""
    parts = Path(str(path)).parts
    for i, part in enumerate(parts):
        match = re.fullmatch(r"seed(\d+)", part)
        if match and i > 0:
            return parts[i - 1], int(match.group(1))
    return Path(str(path)).parent.name, None


def geometry(study: Path) -> dict[str, dict]:
    """Per job: W and R_exact of its model (from a suite run's summary.json settings)."""
    out = {}
    for path in sorted((study / "suite").glob("*/seed*/summary.json")):
        try:
            record = read_json(path)
        except DamagedRecord as exc:
            print(f"[findings] warning: {exc}; its W and R_exact are read from another run "
                  "of the job, if any", file=sys.stderr)
            continue
        settings = record.get("run", {}).get("settings") or record.get("settings", {})
        match = _LABEL.match(f"{path.parent.parent.name}/{path.parent.name}")
        if match is not None:
            out.setdefault(match["job"] + match["variant"],
                           {"W": settings.get("window"), "R_exact": settings.get("r_exact")})
    return out


def run_traits(study: Path) -> pd.DataFrame:
    """Per trained model (`runs/<job>/seed<k>/config.yaml`): job, seed, L_d (decoder layers),
    W, shift_tokens, the replay-simulation probability and length it was trained with, and
    `arm`: `sim` (replay simulation on) or `no_sim`, with `+shift<s>` when the model mixes input
    tokens. Empty when the study has no run configs."""
    from omegaconf import OmegaConf
    rows = []
    for path in sorted((study / "runs").glob("*/seed*/config.yaml")):
        match = re.fullmatch(r"seed(\d+)", path.parent.name)
        if match is None:
            continue
        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        model, replay = cfg.get("model", {}), cfg.get("train", {}).get("replay", {})
        probability = float(replay.get("probability") or 0.0)
        shift = int(model.get("shift_tokens") or 0)
        arm = ("sim" if probability > 0 else "no_sim") + (f"+shift{shift}" if shift else "")
        rows.append({"job": path.parent.parent.name, "seed": int(match.group(1)),
                     "L_d": model.get("n_decoder_layers"), "W": model.get("window"),
                     "shift_tokens": shift, "replay_probability": probability,
                     "replay_length": replay.get("length") if probability > 0 else None,
                     "arm": arm})
    return pd.DataFrame(rows)


def per_model_tables(results: pd.DataFrame, study: Path, marks: dict,
                     alpha: float = 0.05) -> dict[str, pd.DataFrame]:
    """The trained model as the unit (`evals.per_model`): `model_drops` (per model x family x
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


def provenance(study: Path) -> dict:
    """Where the numbers come from, from the driver's summary.json: the study, scale and seeds,
    every invocation (command, git commit, whether the tree was dirty, wall time) and the
    seconds spent per kind of step (train / divergence / suite), summed over the steps that
    ran (a skipped or reused step keeps the seconds of the invocation that ran it)."""
    try:
        record = read_json(study / "summary.json")
    except DamagedRecord as exc:
        print(f"[findings] warning: {exc}; the provenance (commands, commits, step times) is "
              "unknown; rerun the study driver on the study to set it aside and rebuild it",
              file=sys.stderr)
        return {"damaged": str(exc)}
    if record is None:
        return {}
    seconds: dict[str, float] = {}
    for key, step in record.get("steps", {}).items():
        if "seconds" in step:
            kind = key.split("/", 1)[0].split(" ", 1)[0]
            seconds[kind] = seconds.get(kind, 0.0) + float(step["seconds"])
    return {"study": record.get("study"), "scale": record.get("scale"),
            "seeds": record.get("seeds"), "invocations": record.get("invocations", []),
            "step_seconds": {k: round(v, 1) for k, v in sorted(seconds.items())},
            "total_step_seconds": round(sum(seconds.values()), 1)}


def _provenance_markdown(info: dict) -> list[str]:
    if not info:
        return ["(no summary.json in the study directory: command and commit unknown)", ""]
    if "damaged" in info:
        return [f"(summary.json is damaged, so command and commit are unknown: "
                f"{info['damaged']})", ""]
    lines = [f"Study `{info['study']}`, scale `{info['scale']}`, seeds {info['seeds']}. "
             f"Step time: {info['total_step_seconds'] / 60:.1f} min on this machine "
             f"({', '.join(f'{k} {v / 60:.1f} min' for k, v in info['step_seconds'].items())}).",
             "", "| command | commit | tree | wall time |", "|---|---|---|---|"]
    for run in info["invocations"]:
        commit = (run.get("commit") or "unknown")[:10]
        tree = "dirty" if run.get("dirty") else "clean" if run.get("commit") else "?"
        lines.append(f"| `{run.get('command', '?')}` | {commit} | {tree} | "
                     f"{float(run.get('elapsed_s', 0)) / 60:.1f} min |")
    return lines + [""]


def replay_of(mode: str, r_exact: int | None) -> float:
    """N of a single-turn replay mode (`replay=exact`: R_exact); NaN for `full`, multi-turn
    and anything else."""
    from evals.modes import parse_mode
    try:
        parsed = parse_mode(mode)
    except ValueError:
        return math.nan
    if parsed.turn is not None or parsed.replay is None:
        return math.nan
    if parsed.replay == "exact":
        return float(r_exact) if r_exact else math.nan
    return float(parsed.replay)


def with_replay_length(table: pd.DataFrame, marks: dict) -> pd.DataFrame:
    """`table` (with job and mode columns) plus N, the replay length of each row's mode."""
    if table.empty:
        return table.assign(N=[])
    n = [replay_of(mode, marks.get(job, {}).get("R_exact"))
         for job, mode in zip(table["job"], table["mode"])]
    return table.assign(N=n)


def _markdown(table: pd.DataFrame, columns: list[str], digits: int = 3) -> str:
    if table.empty:
        return "(none)\n"
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for rec in table[columns].to_dict("records"):
        cells = []
        for col in columns:
            v = rec[col]
            if isinstance(v, float):
                cells.append("" if math.isnan(v) else f"{v:.{digits}g}" if abs(v) < 1e-3 and v
                             else f"{v:.{digits}f}")
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_findings(study: Path, out: Path, alpha: float = 0.05,
                   compare: list[tuple[str, str]] | None = None) -> dict[str, Path]:
    """Compute every table and figure of the module doc for `study` into `out`; `compare`:
    job pairs (from, to) for arms.csv beside those that differ in one setting."""
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(study)
    marks = geometry(study)
    accuracy = accuracy_table(results)
    tables = {"accuracy": accuracy, "capability_drop": capability_drop_table(results, alpha),
              "competence": competence_table(accuracy), "divergence": divergence_table(study),
              "answer_kl": answer_kl_table(results),
              "override_drop": reference_drop_table(results, alpha),
              "needle_ids": needle_id_table(results, _load_needle_documents(study)),
              **per_model_tables(results, study, marks, alpha),
              "arms": arms.arms_table(results, arms.job_pairs(
                  study, list(results["job"].unique()), compare), marks)}
    tables["exact_violations"] = exact_mode_check(tables["capability_drop"], marks)
    for _, row in tables["exact_violations"].iterrows():
        print(f"[findings] WARNING: {row['job']} {row['family']} `{row['mode']}` is exact by "
              f"the contract but changed {row['full_only'] + row['mode_only']} of {row['n']} "
              f"answers against full (exact_violations.csv)", file=sys.stderr)
    written = {}
    optional = ("override_drop", "needle_ids", "model_drops", "failure_rate", "n_star",
                "exact_violations", "arms")
    for name, table in tables.items():
        if name in optional and table.empty:
            continue
        written[name] = out / f"{name}.csv"
        table.to_csv(written[name], index=False, float_format="%.6g")
    written.update(_write_figures(tables, marks, out))
    info = provenance(study)
    written["provenance"] = out / "provenance.json"
    write_json(written["provenance"], info)
    written["findings"] = out / "findings.md"
    text = _findings_markdown(study, info, marks, tables, alpha)
    check = check_prediction(info, out)
    if check is not None:
        written["prediction_check"] = out / "prediction_check.json"
        write_json(written["prediction_check"], check.to_dict())
        text += f"\n## Registered prediction\n\n{check.line()}\n"
        print(f"[findings] {check.line()}", file=sys.stderr)
    written["findings"].write_text(text)
    return written


def check_prediction(info: dict, out: Path):
    """`evals.predictions.check` of `findings/predictions/<study>.md` against the study's
    invocations (`info`: `provenance`), in the git repository that holds `out` (else this
    checkout); None when the study has no registered prediction."""
    study = info.get("study")
    here = Path(__file__).resolve().parents[1]
    repo = next((p for p in [out.resolve(), *out.resolve().parents] if (p / ".git").exists()),
                here)
    path = predictions.prediction_for(repo, study) if study else None
    if path is None:
        return None
    return predictions.check(repo, path, info.get("invocations", []))


def _write_figures(tables: dict, marks: dict, out: Path) -> dict[str, Path]:
    """accuracy_vs_N.png, kl_vs_N.png (the drops only where the exact model is competent) and,
    with job pairs, arms.png."""
    accuracy, drops = tables["accuracy"], tables["capability_drop"]
    divergence, competence = tables["divergence"], tables["competence"]
    written = {}
    pooled = accuracy[accuracy["x"] == "all"]
    figure = plots.findings_accuracy_figure(with_replay_length(pooled, marks),
                                            pooled[pooled["mode"] == FULL], marks)
    if figure is not None:
        written["accuracy_vs_N"] = plots.save(figure, out / "accuracy_vs_N.png", title_room=True)
    kl = divergence[divergence["metric"] == "kl"] if not divergence.empty else divergence
    competent = competence[competence["competent"]][["job", "family"]]
    drop_points = (drops[drops["x"] == "all"].merge(competent, on=["job", "family"])
                   if not drops.empty else drops)
    written["kl_vs_N"] = plots.save(plots.findings_divergence_figure(
        with_replay_length(kl, marks), with_replay_length(drop_points, marks), marks,
        answer_kl=with_replay_length(tables["answer_kl"], marks)), out / "kl_vs_N.png")
    figure = plots.arms_figure(tables["arms"])
    if figure is not None:
        written["arms_png"] = plots.save(figure, out / "arms.png", title_room=True)
    return written


def _findings_markdown(study: Path, info: dict, marks: dict, tables: dict,
                       alpha: float) -> str:
    """findings.md: the tables of write_findings, each under a heading that says what it is."""
    drops, violations = tables["capability_drop"], tables["exact_violations"]
    against_base, needle_ids = tables["override_drop"], tables["needle_ids"]
    pooled_drops = drops[drops["x"] == "all"] if not drops.empty else drops
    md = [f"# {study.name}: seed-pooled findings tables (python -m evals.findings)", "",
          *_provenance_markdown(info),
          f"Geometry per job: {json.dumps(marks)}", "",
          "## Competence of the exact model (`full`, pooled over distances and seeds)", "",
          _markdown(tables["competence"], ["job", "family", "seeds", "n", "accuracy", "ci_low",
                                           "ci_high", "seed_ci_low", "seed_ci_high", "per_seed",
                                           "competent"]),
          "## Capability drop pooled over distances (mode - full, paired, pooled over seeds)",
          "", _markdown(pooled_drops, ["job", "family", "mode", "seeds", "n", "acc_full",
                                       "acc_mode", "difference", "ci_low", "ci_high",
                                       "seed_ci_low", "seed_ci_high", "p_value", "seed_p",
                                       "per_seed_difference", "per_seed_p"]),
          "## Significant drops at single distances (Holm over distances, p < "
          f"{alpha})", "",
          _markdown(drops[(drops["x"] != "all") & drops["significant"]] if not drops.empty
                    else drops, ["job", "family", "x", "mode", "n", "acc_full", "acc_mode",
                                 "difference", "ci_low", "ci_high", "p_holm",
                                 "per_seed_difference"])]
    if not against_base.empty:
        md += ["## Evaluation-time overrides against the unmodified model (pooled over "
               "distances; `full` of an override is its cost alone)", "",
               _markdown(against_base[against_base["x"] == "all"],
                         ["job", "family", "mode", "n", "acc_full", "acc_mode", "difference",
                          "ci_low", "ci_high", "p_value", "agree", "per_seed_difference"])]
    if not needle_ids.empty:
        md += ["## Needle: `full` accuracy by the nearest distractor id, and what the wrong "
               "answers are", "",
               _markdown(needle_ids, ["job", "slice", "n", "accuracy", "ci_low", "ci_high",
                                      "per_seed", "wrong", "one_wrong_digit",
                                      "digit_from_nearest", "other_line_code"])]
    md += ["## Exact modes (N >= R_exact, or a policy that rebuilds every state exactly)", "",
           "Every exact mode gave `full`'s answer on every example.\n" if violations.empty
           else "**Exact modes that changed answers** (a bug, or round-off at near-ties):\n\n"
           + _markdown(violations, ["job", "family", "mode", "n", "full_only", "mode_only"])]
    md += _per_model_markdown(tables) + _arms_markdown(tables["arms"])
    md += ["## KL(full || mode) at the answer (suite examples, teacher-forced; mean over "
           "examples and seeds, bootstrap 95% CI)", "",
           _markdown(tables["answer_kl"], ["job", "family", "mode", "seeds", "n", "mean",
                                           "ci_low", "ci_high", "seed_ci_low", "seed_ci_high",
                                           "per_seed"], 3),
           "## First-token divergence at a validation prompt's cut (mean over prompts and "
           "seeds, bootstrap 95% CI)", "",
           _markdown(tables["divergence"], ["job", "T", "mode", "metric", "seeds", "n", "mean",
                                            "ci_low", "ci_high", "seed_ci_low", "seed_ci_high",
                                            "per_seed"], 3)]
    return "\n".join(md)


def _arms_markdown(table: pd.DataFrame) -> list[str]:
    """The job-against-job section of findings.md (none without a pair of jobs)."""
    if table.empty:
        return []
    return ["## Job against job (to - from, pooled over distances; example-level CI paired by "
            "document where both jobs read the same ones, model-level CI and Welch p with the "
            "models as the unit)", "",
            _markdown(table, ["from", "to", "differs", "family", "mode", "metric", "models_from",
                              "models_to", "value_from", "value_to", "difference", "ci_low",
                              "ci_high", "seed_ci_low", "seed_ci_high", "welch_p", "pairing"])]


def _per_model_markdown(tables: dict) -> list[str]:
    """The failure rate and N* sections of findings.md (none where no model was judged)."""
    if tables["failure_rate"].empty:
        return []
    return ["## Models that fail (the trained model as the unit: a significant drop, Holm "
            f"over its competent families, larger than {per_model.FAIL_MIN_DROP:g}; "
            "Clopper-Pearson 95% CI)", "",
            _markdown(tables["failure_rate"], ["job", "mode", "N", "models", "failed", "rate",
                                               "rate_low", "rate_high", "failed_seeds"]),
            "## N* per model (smallest N from W with every competent family within "
            f"{per_model.STAR_MAX_DROP:g} of `full` and answer KL <= "
            f"{per_model.STAR_MAX_KL:g} nats)", "",
            _markdown(tables["n_star"], ["job", "arm", "seed", "L_d", "W", "R_exact", "N_star",
                                         "drop_at_W", "failed_at_W", "grid"])]


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", help="a study directory (outputs/studies/<name>)")
    p.add_argument("--out", help="output directory (e.g. findings/<name>)")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--compare", nargs="*", default=[], metavar="FROM:TO",
                   help="job pairs for arms.csv beside the jobs whose training settings differ "
                        "in one key, e.g. no_sim:sim_fixed_W")
    p.add_argument("--seed-t", metavar="FINDINGS_DIR", type=Path,
                   help="instead: add seed-level t intervals to an existing findings directory "
                        "whose study directory is gone (writes <dir>/seed_level.csv)")
    args = p.parse_args(argv)
    if args.seed_t is not None:
        target = ("--seed-t", args.seed_t)
    elif not args.study or not args.out:
        p.error("--study and --out are required (or --seed-t FINDINGS_DIR)")
    else:
        target = ("--out", args.out)
    try:
        check_output_dir(target[1], target[0])
    except OutputDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seed_t is not None:
        return list_written("findings", lambda: write_seed_t(args.seed_t))
    study = Path(args.study)
    if not (study / "suite").is_dir() and (study / "real_text").is_dir():
        from evals.real_text import publish
        return list_written("findings", lambda: publish(study, Path(args.out)))
    if not (study / "suite").is_dir():
        p.error(f"--study {study}: no suite/ or real_text/ directory (is it a study "
                "directory?)")
    pairs = [tuple(item.split(":")) for item in args.compare]
    bad = [item for item, pair in zip(args.compare, pairs) if len(pair) != 2 or not all(pair)]
    if bad:
        print(f"error: --compare: expected FROM:TO (two job names), got {bad[0]!r}",
              file=sys.stderr)
        return 2
    return list_written("findings", lambda: write_findings(study, Path(args.out), args.alpha,
                                                           pairs),
                        errors=(FileNotFoundError, arms.CompareError))


def list_written(tag: str, write, errors: tuple = (FileNotFoundError,)) -> int:
    """Run `write()` (-> {name: path}) and print each path as `[tag] name: path`; a missing
    input (FileNotFoundError, or any of `errors`) is one line and exit code 2."""
    try:
        written = write()
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in written.items():
        print(f"[{tag}] {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
