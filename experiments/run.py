"""Run a named study: train its jobs, evaluate them, write the report. Resumes what is done.

    python -m experiments.run study=<name> [out=outputs/studies/<name>] [scale=demo|full]
                              [threads=2] [wandb=true] [only=train|eval|report]

A study is `conf/experiment/<name>.yaml` (see README.md, "Studies"): training jobs as
Hydra override lists for `python -m ced.train`, plus divergence and suite settings. Layout of
the study directory:

    runs/<job>/             each job's Hydra run directory (metrics.jsonl, final/, wandb/)
    divergence/             evals.divergence over every trained checkpoint with a decoder
    suite/<label>/          evals.suites per checkpoint (and per eval-time top-k override)
    logs/<step>.log         the full output of every subprocess
    report/                 report.md, report.html, PNG plots (evals.report)
    summary.json            the status of every step: ok / skipped (done before) / failed

A job whose `final/model.safetensors` exists is not trained again; an evaluation whose outputs
exist is not run again. A failed step is recorded (return code, last lines of output) and the
others go on; the exit code is 1 if anything failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
STUDY_DIR = ROOT / "conf" / "experiment"
TAIL_BYTES = 4000


# ---- the study config --------------------------------------------------------------------------

def load_study(name: str, scale: str = "demo") -> dict:
    """conf/experiment/<name>.yaml with its `scales.<scale>` section applied (train overrides
    appended, divergence/suite keys merged)."""
    path = Path(name) if name.endswith(".yaml") else STUDY_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))
        raise SystemExit(f"study {name!r}: no {path}; known studies: {known}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    scales = raw.pop("scales", {}) or {}
    if scale not in scales and scale not in ("demo", "full"):
        raise SystemExit(f"scale {scale!r}: the study defines {sorted(scales)}")
    extra = scales.get(scale) or {}
    study = {"name": raw.get("name", path.stem), "description": raw.get("description", ""),
             "train": list(raw.get("train") or []) + list(extra.get("train") or []),
             "jobs": list(raw.get("jobs") or []),
             "divergence": {**(raw.get("divergence") or {}), **(extra.get("divergence") or {})},
             "suite": {**(raw.get("suite") or {}), **(extra.get("suite") or {})},
             "scale": scale}
    if raw.get("divergence") is None and "divergence" in raw:
        study["divergence"] = None
    if raw.get("suite") is None and "suite" in raw:
        study["suite"] = None
    names = [j["name"] for j in study["jobs"]]
    if len(set(names)) != len(names) or not names:
        raise SystemExit(f"study {name!r}: jobs need distinct names; got {names}")
    return study


def resolve_lengths(values: list, cfg: dict) -> list:
    """Replay lengths written as ints or as 'W', 'W/4', '2W', 'R_exact' -> ints (for `cfg`, a
    checkpoint's config.json); duplicates dropped, order kept."""
    from ced import ModelConfig, exact_replay_length
    model = ModelConfig(**{k: v for k, v in cfg.items() if k in ModelConfig.__dataclass_fields__})
    w = model.window
    r = exact_replay_length(model) if model.has_decoder else None
    out = []
    for v in values:
        if isinstance(v, str) and v != "exact":
            text = v.replace(" ", "")
            if text == "R_exact":
                if r is None:
                    continue
                v = r
            elif "W" in text:
                head, _, tail = text.partition("W")
                v = int(head or 1) * w
                if tail.startswith("/"):
                    v //= int(tail[1:])
            else:
                v = int(text)
            v = max(1, int(v))
        if v not in out:
            out.append(v)
    return out


# ---- subprocesses ---------------------------------------------------------------------------

def stream(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str]:
    """Run `cmd`, copying its output (stdout and stderr) to ours and to `log` as it comes;
    returns (return code, the last lines)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail = b""
    with open(log, "wb") as handle:
        handle.write(("$ " + " ".join(cmd) + "\n").encode())
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        assert proc.stdout is not None
        while True:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            handle.write(chunk)
            tail = (tail + chunk)[-TAIL_BYTES:]
        code = proc.wait()
    text = tail.decode(errors="replace").replace("\r", "\n")
    lines = [ln for ln in text.splitlines() if ln.strip()][-12:]
    return code, "\n".join(lines)


def banner(text: str) -> None:
    print(f"\n=== [study] {text} ===", flush=True)


# ---- the steps --------------------------------------------------------------------------------

class Study:
    def __init__(self, spec: dict, out: Path, threads: int, wandb: bool = True):
        self.spec, self.out, self.threads, self.wandb = spec, out, threads, wandb
        self.status: dict[str, dict] = {}
        self.started = time.time()
        self.env = {"WANDB_RUN_GROUP": spec["name"], "WANDB_SILENT": "true",
                    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                    "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        os.environ.setdefault("WANDB_MODE", "offline")

    # bookkeeping
    def record(self, key: str, state: str, **info: Any) -> None:
        self.status[key] = {"state": state, **info}
        self.write_summary()

    def write_summary(self) -> None:
        failed = [k for k, v in self.status.items() if v["state"] == "failed"]
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "summary.json").write_text(json.dumps({
            "study": self.spec["name"], "scale": self.spec["scale"],
            "description": self.spec["description"], "out": str(self.out),
            "steps": self.status, "failed": failed,
            "elapsed_s": round(time.time() - self.started, 1)}, indent=1))

    def run_dir(self, job: str) -> Path:
        return self.out / "runs" / job

    def checkpoints(self) -> dict[str, Path]:
        """job -> final/ of every job that has finished training."""
        out = {}
        for job in self.spec["jobs"]:
            final = self.run_dir(job["name"]) / "final"
            if (final / "model.safetensors").exists():
                out[job["name"]] = final
        return out

    # training
    def train(self) -> None:
        jobs = self.spec["jobs"]
        for i, job in enumerate(jobs, 1):
            name, key = job["name"], f"train/{job['name']}"
            run_dir = self.run_dir(name)
            if (run_dir / "final" / "model.safetensors").exists():
                print(f"[study] train {name}: done before, skipped", flush=True)
                self.record(key, "skipped", run_dir=str(run_dir))
                continue
            overrides = [*self.spec["train"], *job.get("overrides", []),
                         f"train.threads={self.threads}", "train.resume=auto",
                         f"logging.group={self.spec['name']}",
                         f"logging.name={self.spec['name']}-{name}",
                         f"hydra.run.dir={run_dir}"]
            if not self.wandb:
                overrides.append("logging=none")
            banner(f"train {i}/{len(jobs)}: {name} ({' '.join(job.get('overrides', []))})")
            t0 = time.time()
            code, tail = stream([sys.executable, "-m", "ced.train", *overrides],
                                self.out / "logs" / f"train_{name}.log", self.env)
            secs = round(time.time() - t0, 1)
            if code == 0 and (run_dir / "final" / "model.safetensors").exists():
                self.record(key, "ok", run_dir=str(run_dir), seconds=secs)
            else:
                print(f"[study] train {name}: FAILED (exit {code}); continuing", flush=True)
                self.record(key, "failed", returncode=code, tail=tail, seconds=secs,
                            log=str(self.out / "logs" / f"train_{name}.log"))

    def _reference_config(self, checkpoints: dict[str, Path]) -> dict | None:
        """The config.json of the first checkpoint with a decoder (or the first one)."""
        configs = [json.loads((p / "config.json").read_text()) for p in checkpoints.values()]
        with_decoder = [c for c in configs if c.get("variant") in ("yoco", "ced")]
        return (with_decoder or configs or [None])[0]

    # divergence
    def divergence(self) -> None:
        spec, key = self.spec.get("divergence"), "divergence"
        if spec is None:
            return
        checkpoints = self.checkpoints()
        usable = {j: p for j, p in checkpoints.items()
                  if json.loads((p / "config.json").read_text()).get("variant") in ("yoco", "ced")}
        if not usable:
            self.record(key, "skipped", reason="no trained checkpoint with a decoder")
            return
        out = self.out / "divergence"
        done = out / "done.json"
        wanted = sorted(str(p) for p in usable.values())
        if done.exists() and json.loads(done.read_text()).get("checkpoints") == wanted:
            print("[study] divergence: done before, skipped", flush=True)
            self.record(key, "skipped", out=str(out))
            return
        config = dict(spec)
        config["replays"] = [v for v in resolve_lengths(
            config.get("replays", [1, 4, 16]), self._reference_config(usable)) if v != "exact"]
        config["checkpoints"] = wanted
        config["out_dir"] = str(out)
        config.setdefault("wandb", {})
        config["wandb"] = {"enabled": self.wandb, "group": self.spec["name"],
                           **config["wandb"]}
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=1))
        banner(f"divergence: {len(usable)} checkpoints, N={config['replays']}, "
               f"T={config.get('lengths')}")
        t0 = time.time()
        code, tail = stream([sys.executable, "-m", "experiments.divergence_job",
                             str(out / "config.json"), str(self.threads)],
                            self.out / "logs" / "divergence.log", self.env)
        secs = round(time.time() - t0, 1)
        if code == 0 and (out / "summary.json").exists():
            done.write_text(json.dumps({"checkpoints": wanted}))
            self.record(key, "ok", out=str(out), seconds=secs)
        else:
            print(f"[study] divergence: FAILED (exit {code}); continuing", flush=True)
            self.record(key, "failed", returncode=code, tail=tail, seconds=secs)

    # suite
    def suite(self) -> None:
        spec = self.spec.get("suite")
        if spec is None:
            return
        checkpoints = self.checkpoints()
        if not checkpoints:
            self.record("suite", "skipped", reason="no trained checkpoint")
            return
        ref = self._reference_config(checkpoints)
        replays = [v for v in resolve_lengths(spec.get("replay", [8]), ref) if v != "exact"]
        topks = spec.get("topk") or [None]
        for job, final in checkpoints.items():
            variant = json.loads((final / "config.json").read_text()).get("variant")
            for topk in topks:
                if topk is not None and variant not in ("ced",):
                    continue    # top-k overrides apply to models with a lightning indexer
                label = job if topk is None else f"{job}@topk={topk}"
                key, out = f"suite/{label}", self.out / "suite" / label
                if (out / "summary.json").exists():
                    print(f"[study] suite {label}: done before, skipped", flush=True)
                    self.record(key, "skipped", out=str(out))
                    continue
                cmd = [sys.executable, "-m", "evals.suites", "--checkpoint", str(final),
                       "--replay", *map(str, replays), "--out", str(out),
                       "--examples", str(spec.get("examples", 20)),
                       "--threads", str(self.threads),
                       *[str(a) for a in spec.get("args", [])]]
                if spec.get("families"):
                    cmd += ["--families", *spec["families"]]
                if spec.get("turns"):
                    cmd += ["--turns", *map(str, resolve_lengths(spec["turns"], ref))]
                if topk is not None:
                    cmd += ["--topk", str(topk)]
                if self.wandb:
                    cmd += ["--wandb", "--wandb-project", "ced"]
                banner(f"suite {label}: N={replays}")
                t0 = time.time()
                code, tail = stream(cmd, self.out / "logs" / f"suite_{label}.log", self.env)
                secs = round(time.time() - t0, 1)
                if code == 0 and (out / "summary.json").exists():
                    self.record(key, "ok", out=str(out), seconds=secs)
                else:
                    print(f"[study] suite {label}: FAILED (exit {code}); continuing", flush=True)
                    self.record(key, "failed", returncode=code, tail=tail, seconds=secs)

    # report
    def report(self) -> Path | None:
        banner("report")
        path = self.out / "report" / "report.html"
        self.record("report", "ok", path=str(path))     # what the report shows about itself
        try:
            from evals.report import build_report
            path = build_report(self.out, wandb=self.wandb)
        except Exception as exc:    # a broken report must not hide the study's results
            import traceback
            traceback.print_exc()
            self.record("report", "failed", error=f"{type(exc).__name__}: {exc}")
            return None
        return path


def parse_argv(argv: list[str]) -> dict:
    args = {"study": None, "out": None, "scale": "demo", "threads": None, "wandb": "true",
            "only": "all"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in args:
            raise SystemExit(f"usage: python -m experiments.run study=<name> [out=DIR] "
                             f"[scale=demo|full] [threads=N] [wandb=true|false] "
                             f"[only=train|eval|report]; got {item!r}")
        args[key] = value
    if not args["study"]:
        known = sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))
        raise SystemExit(f"study=<name> is required; known studies: {known}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_argv(sys.argv[1:] if argv is None else argv)
    spec = load_study(args["study"], args["scale"])
    out = Path(args["out"] or ROOT / "outputs" / "studies" / spec["name"]).resolve()
    threads = int(args["threads"] or min(os.cpu_count() or 1, 8))
    study = Study(spec, out, threads, wandb=args["wandb"].lower() in ("1", "true", "yes"))
    old = out / "summary.json"
    if old.exists():   # keep the record of steps this invocation does not redo
        try:
            study.status = json.loads(old.read_text()).get("steps", {})
        except ValueError:
            pass
    print(f"[study] {spec['name']} (scale={spec['scale']}): {len(spec['jobs'])} jobs -> {out}",
          flush=True)
    only = args["only"]
    if only in ("all", "train"):
        study.train()
    if only in ("all", "eval"):
        study.divergence()
        study.suite()
    path = None
    if only in ("all", "report"):
        path = study.report()
    study.write_summary()
    failed = [k for k, v in study.status.items() if v["state"] == "failed"]
    elapsed = time.time() - study.started
    print(f"\n[study] {spec['name']} finished in {elapsed:.0f}s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all steps ok"), flush=True)
    print(f"summary: {out / 'summary.json'}")
    if path is not None:
        print(f"report: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
