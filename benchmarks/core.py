"""Core CPU benchmarks for the CED model family (run with `make bench-core`).

What is measured (CPU, fp32, torch's default thread count), on one configuration:
d_model 256, n_heads 4, 8 encoder + 8 decoder layers, window 64, vocab 259, max_seq_len 8192,
batch 1, T = 2048; variants `dense` and `ced` (topk 64, global_from_layer 2,
encoder_kv_groups 3, encoder_compress_ratio 2, decoder_compress_ratio 1,
decoder_reindex_every 4).

1. Training throughput: forward + backward tokens/s of dense and of ced (loss = next-token
   cross-entropy, plus the indexer KL for ced), 1 warm-up step then the median of the timed
   steps. Target: ced >= 0.7x dense.
2. Prefill wall time of the ced model at T = 2048 with `InferenceEngine.prefill`: full
   (replay=None), early exit with replay = window (64), and early exit with the exact replay
   length. Target: replay = window <= 0.6x the full prefill time (the layer-matmul FLOP ratio
   (L_e*T + L_d*N) / ((L_e + L_d)*T) is about 0.52; it is printed as an estimate).
3. Peak memory of an early-exit prefill (replay = window) at T = 8192 for the ced model: the
   increase of the process peak RSS across the prefill, measured in a fresh subprocess
   (`--peak-memory-child`): VmHWM (reset just before the prefill) minus VmRSS before it, with
   the ru_maxrss increase as a cross-check. Target: under 4 GB.

Timings: the machine may be shared, so each timed run first waits (within a 120 s budget for
the whole run) until other processes use < 0.25 cores, and records how many cores others used
during it; the table flags a NOISY run.

Results are printed as a table and written to benchmarks/results/core.json
(core-quick.json with --quick).
`--quick` runs the same measurements at small sizes (a smoke test; targets are not meaningful).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from ced import CEDModel, InferenceEngine, ModelConfig, exact_replay_length  # noqa: E402

RESULTS = ROOT / "results" / "core.json"
SEED = 0
COMMON = dict(d_model=256, n_heads=4, n_encoder_layers=8, n_decoder_layers=8, window=64,
              vocab_size=259, max_seq_len=8192)
# the benchmarked ced's sparse read (inference.py and peer.py use this one)
CED_FIELDS = dict(topk=64, global_from_layer=2, encoder_kv_groups=3, encoder_compress_ratio=2,
                  decoder_compress_ratio=1, decoder_reindex_every=4)

TARGET_TRAIN_RATIO = 0.7
TARGET_PREFILL_RATIO = 0.6
TARGET_PEAK_MB = 4096.0


def log(message: str) -> None:
    print(f"[bench-core {time.strftime('%H:%M:%S')}] {message}", flush=True)


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        # optional here: a machine without numpy still seeds random and torch
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def make_config(variant: str) -> ModelConfig:
    return ModelConfig(variant=variant, **COMMON, **(CED_FIELDS if variant == "ced" else {}))


def make_model(variant: str) -> CEDModel:
    seed_everything()
    return CEDModel(make_config(variant))


def make_ids(length: int, vocab: int, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + length)
    return torch.randint(0, vocab, (batch, length), generator=generator)


# ---- contention: this machine may be shared; measure and avoid other processes' CPU use ---------

_QUIET_BUDGET_S = [120.0]   # total seconds the whole run may spend waiting for a quiet machine


def _machine_busy_s() -> float | None:
    """CPU seconds all processes have been busy since boot (Linux /proc/stat), or None."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


class OtherLoad:
    """Average number of cores used by OTHER processes between start and stop."""

    def __enter__(self) -> "OtherLoad":
        self.cores = None
        self._busy, self._own, self._wall = (_machine_busy_s(), time.process_time(),
                                             time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy = _machine_busy_s()
        if busy is None or self._busy is None:
            return
        wall = time.perf_counter() - self._wall
        others = (busy - self._busy) - (time.process_time() - self._own)
        self.cores = max(others, 0.0) / max(wall, 1e-9)


def wait_for_quiet(threshold_cores: float = 0.25, sample_s: float = 0.5) -> float:
    """Wait (within the run's budget) until other processes use < threshold cores."""
    waited = 0.0
    while _QUIET_BUDGET_S[0] > 0:
        with OtherLoad() as load:
            time.sleep(sample_s)
        if load.cores is None or load.cores < threshold_cores:
            break
        waited += sample_s
        _QUIET_BUDGET_S[0] -= sample_s
    if waited:
        log(f"  waited {waited:.1f}s for other processes to go quiet "
            f"(wait budget left {max(_QUIET_BUDGET_S[0], 0):.0f}s)")
    return waited


def timed(fn, warmup: int, iters: int, label: str) -> tuple[list[float], list[float | None]]:
    """Warm-up calls, then `iters` timed calls; returns wall times and, per timed call, the
    average cores other processes used meanwhile (None where unknown)."""
    for i in range(warmup):
        start = time.perf_counter()
        fn()
        log(f"  {label}: warm-up {i + 1}/{warmup} {time.perf_counter() - start:.2f}s")
    times, others = [], []
    for i in range(iters):
        wait_for_quiet()
        with OtherLoad() as load:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        others.append(load.cores)
        note = "" if load.cores is None else f" (other processes: {load.cores:.2f} cores)"
        log(f"  {label}: run {i + 1}/{iters} {times[-1]:.2f}s{note}")
    return times, others


def max_other(*lists: list[float | None]) -> float | None:
    values = [v for values in lists for v in values if v is not None]
    return max(values) if values else None


# ---- 1. training throughput -------------------------------------------------------------

def train_step(model: CEDModel, ids: torch.Tensor) -> float:
    vocab = model.cfg.vocab_size
    if model.cfg.topk is not None:
        logits, aux = model(ids, return_aux=True)
        extra = aux["indexer_kl"]
    else:
        logits, extra = model(ids), 0.0
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)) + extra
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def bench_training(length: int, iters: int) -> dict:
    out = {}
    for variant in ("dense", "ced"):
        log(f"training fwd+bwd: {variant}, T={length}")
        model = make_model(variant)
        model.train()
        ids = make_ids(length, model.cfg.vocab_size)
        times, others = timed(lambda: train_step(model, ids), 1, iters, f"train {variant}")
        median = statistics.median(times)
        out[variant] = {"times_s": times, "median_s": median, "min_s": min(times),
                        "tokens_per_s": length / median, "other_cores": others}
        del model
    out["ratio_ced_over_dense"] = out["ced"]["tokens_per_s"] / out["dense"]["tokens_per_s"]
    return out


# ---- 2. prefill -----------------------------------------------------------------------------

def bench_prefill(length: int, iters: int) -> dict:
    model = make_model("ced")
    model.eval()
    cfg = model.cfg
    engine = InferenceEngine(model)
    ids = make_ids(length, cfg.vocab_size)
    out: dict = {}
    cases = (("full", None), ("replay_window", cfg.window), ("replay_exact", "exact"))
    for name, replay in cases:
        log(f"prefill ced: {name} (replay={replay!r}), T={length}")
        with torch.no_grad():
            times, others = timed(lambda: engine.prefill(ids, replay=replay), 1, iters,
                                  f"prefill {name}")
        n = engine.resolve_replay(replay, length)
        out[name] = {"replay": n, "times_s": times, "median_s": statistics.median(times),
                     "min_s": min(times), "other_cores": others}
    out["ratio_window_over_full"] = out["replay_window"]["median_s"] / out["full"]["median_s"]
    out["ratio_exact_over_full"] = out["replay_exact"]["median_s"] / out["full"]["median_s"]
    le, ld = cfg.n_encoder_layers, cfg.n_decoder_layers
    for key, n in (("flop_ratio_estimate_window", out["replay_window"]["replay"]),
                   ("flop_ratio_estimate_exact", out["replay_exact"]["replay"])):
        out[key] = (le * length + ld * n) / ((le + ld) * length)
    return out


# ---- 3. peak memory (in a fresh subprocess) ---------------------------------------------------

def maxrss_mb() -> float:
    """Process peak RSS from getrusage. Caveat: Linux carries it across fork + exec, so a child
    starts with its parent's peak; the parent therefore runs this child first, while small."""
    scale = 1.0 / 1024 if sys.platform != "darwin" else 1.0 / (1024 * 1024)  # KiB vs bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def proc_status_mb(field: str) -> float | None:
    """VmRSS / VmHWM of this process (Linux); VmHWM is per address space, reset at exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_rise(fn) -> dict:
    """Run `fn()` once and measure how far this process's peak resident memory rose over its
    resident memory just before: VmHWM after minus VmRSS before, VmHWM reset to the current
    RSS first (Linux); where that reset is refused, VmHWM after minus before; without
    /proc, getrusage's ru_maxrss after minus before. Returns the rise in MB ("increase_mb"),
    the method used, every reading taken, fn's wall time ("seconds") and its return value
    ("result")."""
    rss_before = proc_status_mb("VmRSS")
    hwm_reset = reset_peak_rss()
    hwm_before = proc_status_mb("VmHWM")
    ru_before = maxrss_mb()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    hwm_after, ru_after = proc_status_mb("VmHWM"), maxrss_mb()
    if hwm_after is not None and rss_before is not None:
        base = rss_before if hwm_reset else hwm_before
        increase, method = hwm_after - base, ("VmHWM - VmRSS (HWM reset)" if hwm_reset
                                              else "VmHWM after - before")
    else:
        increase, method = ru_after - ru_before, "ru_maxrss after - before"
    return {"increase_mb": increase, "method": method, "rss_before_mb": rss_before,
            "vmhwm_before_mb": hwm_before, "vmhwm_after_mb": hwm_after,
            "maxrss_before_mb": ru_before, "maxrss_after_mb": ru_after,
            "maxrss_increase_mb": ru_after - ru_before, "seconds": elapsed, "result": result}


def peak_memory_child(length: int) -> None:
    """Runs in a fresh process: builds the ced model, then one early-exit prefill (replay =
    window) at T=length; prints one JSON line with the peak RSS before and after it
    (`peak_rss_rise`)."""
    model = make_model("ced")
    model.eval()
    engine = InferenceEngine(model)
    ids = make_ids(length, model.cfg.vocab_size)
    with torch.no_grad():
        rise = peak_rss_rise(lambda: engine.prefill(ids, replay=model.cfg.window))
    result, seconds = rise.pop("result"), rise.pop("seconds")
    print(json.dumps({"T": length, "replay": result.replay, **rise, "prefill_s": seconds,
                      "cache_mb": result.cache.nbytes()["total"] / 2 ** 20}), flush=True)


def bench_peak_memory(length: int) -> dict:
    log(f"peak memory: early-exit prefill (replay=window), T={length}, in a subprocess")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--peak-memory-child",
                           "--memory-T", str(length)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"peak-memory child failed (rc={proc.returncode}):\n{proc.stderr}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    result = json.loads(line)
    log(f"  peak RSS increase {result['increase_mb']:.0f} MB ({result['method']}); ru_maxrss "
        f"{result['maxrss_before_mb']:.0f} -> {result['maxrss_after_mb']:.0f} MB; prefill "
        f"{result['prefill_s']:.2f}s")
    return result


# ---- report ---------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def report(res: dict, quick: bool) -> list[tuple[str, str, str, str]]:
    tr, pf, mem = res["training"], res["prefill"], res["peak_memory"]
    t_train, t_mem = res["T_train_prefill"], res["T_memory"]
    rows = [
        (f"train fwd+bwd dense tokens/s (T={t_train})", f"{tr['dense']['tokens_per_s']:.0f}",
         "", ""),
        (f"train fwd+bwd ced topk=64 tokens/s (T={t_train})", f"{tr['ced']['tokens_per_s']:.0f}",
         "", ""),
        ("train ratio ced / dense", f"{tr['ratio_ced_over_dense']:.3f}",
         f">= {TARGET_TRAIN_RATIO}", verdict(tr["ratio_ced_over_dense"] >= TARGET_TRAIN_RATIO)),
        (f"prefill ced full (T={t_train})", f"{pf['full']['median_s'] * 1e3:.0f} ms", "", ""),
        (f"prefill ced replay=window (N={pf['replay_window']['replay']})",
         f"{pf['replay_window']['median_s'] * 1e3:.0f} ms", "", ""),
        (f"prefill ced replay=exact (N={pf['replay_exact']['replay']})",
         f"{pf['replay_exact']['median_s'] * 1e3:.0f} ms", "", ""),
        ("prefill ratio replay=window / full", f"{pf['ratio_window_over_full']:.3f}",
         f"<= {TARGET_PREFILL_RATIO}",
         verdict(pf["ratio_window_over_full"] <= TARGET_PREFILL_RATIO)),
        ("prefill ratio replay=exact / full", f"{pf['ratio_exact_over_full']:.3f}", "", ""),
        ("  FLOP ratio estimate, window (layer matmuls)",
         f"{pf['flop_ratio_estimate_window']:.3f}", "(estimate)", ""),
        ("  FLOP ratio estimate, exact (layer matmuls)",
         f"{pf['flop_ratio_estimate_exact']:.3f}", "(estimate)", ""),
        (f"peak RSS increase, early-exit prefill (T={t_mem})", f"{mem['increase_mb']:.0f} MB",
         f"< {TARGET_PEAK_MB:.0f} MB", verdict(mem["increase_mb"] < TARGET_PEAK_MB)),
        ("  ru_maxrss increase (cross-check)", f"{mem['maxrss_increase_mb']:.0f} MB", "", ""),
        ("  process peak RSS during prefill (VmHWM)", f"{mem['vmhwm_after_mb'] or 0:.0f} MB",
         "", ""),
        ("  cache held after prefill", f"{mem['cache_mb']:.1f} MB", "", ""),
    ]
    other = res.get("max_other_cores")
    if other is not None:
        rows.append(("max cores used by other processes in a timed run", f"{other:.2f}",
                     "~0", "NOISY" if other > 0.25 else "ok"))
    widths = [max(len(r[i]) for r in rows + [("measurement", "value", "target", "result")])
              for i in range(4)]
    header = ("measurement", "value", "target", "result")
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print()
    title = "CED core benchmark" + (" (--quick: sizes reduced, targets not meaningful)"
                                    if quick else "")
    print(f"{title}  [CPU fp32, {torch.get_num_threads()} threads, torch {torch.__version__}]")
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join([row[0].ljust(widths[0]), row[1].rjust(widths[1]),
                         row[2].ljust(widths[2]), row[3].ljust(widths[3])]).rstrip())
    print(flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: T=512 (training/prefill) and T=1024 (memory)")
    parser.add_argument("--iters", type=int, default=5,
                        help="timed iterations after one warm-up, median reported (default 5)")
    parser.add_argument("--peak-memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-T", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters < 3:
        parser.error("--iters must be >= 3")

    if args.peak_memory_child:
        peak_memory_child(args.memory_T or 8192)
        return 0

    t_main, t_mem = (512, 1024) if args.quick else (2048, 8192)
    seed_everything()
    log(f"start: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"T={t_main}, memory T={t_mem}{' (quick)' if args.quick else ''}")
    start = time.perf_counter()
    results: dict = {
        "quick": args.quick,
        "T_train_prefill": t_main,
        "T_memory": t_mem,
        "batch": 1,
        "config_common": COMMON,
        "config_ced": CED_FIELDS,
        "exact_replay_length": exact_replay_length(make_config("ced")),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
        "threads": torch.get_num_threads(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
    }
    # Memory first: the child inherits this process's ru_maxrss, which is small before training.
    results["peak_memory"] = bench_peak_memory(t_mem)
    results["training"] = bench_training(t_main, args.iters)
    results["prefill"] = bench_prefill(t_main, args.iters)
    results["loadavg_end"] = os.getloadavg()
    results["max_other_cores"] = max_other(
        *(results["training"][v]["other_cores"] for v in ("dense", "ced")),
        *(results["prefill"][c]["other_cores"] for c in ("full", "replay_window", "replay_exact")))
    results["total_s"] = time.perf_counter() - start
    results["targets"] = _targets(results)
    report(results, args.quick)
    path = RESULTS.with_name("core-quick.json") if args.quick else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    log(f"done in {results['total_s']:.0f}s; results written to "
        f"{path.relative_to(ROOT.parent)}")
    return 0


def _targets(results: dict) -> dict:
    """The three targets: ced's training speed against dense, the early-exit prefill ratio
    and the peak memory of an early-exit prefill."""
    tr, pf, mem = results["training"], results["prefill"], results["peak_memory"]
    return {
        "train_ratio": {"target": f">= {TARGET_TRAIN_RATIO}", "value": tr["ratio_ced_over_dense"],
                        "pass": tr["ratio_ced_over_dense"] >= TARGET_TRAIN_RATIO},
        "prefill_ratio": {"target": f"<= {TARGET_PREFILL_RATIO}",
                          "value": pf["ratio_window_over_full"],
                          "pass": pf["ratio_window_over_full"] <= TARGET_PREFILL_RATIO},
        "peak_memory_mb": {"target": f"< {TARGET_PEAK_MB:.0f}", "value": mem["increase_mb"],
                           "pass": mem["increase_mb"] < TARGET_PEAK_MB},
    }


if __name__ == "__main__":
    sys.exit(main())
