"""The cost report of one config (`python -m ced.cost`): `report` gathers the cost model's
numbers (parameters per component and layer, active parameters, prefill FLOPs and their ratio
against T, KV bytes) into one dict, `render` prints it as aligned text tables. The arithmetic
itself is the package's (`ced.cost`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, exact_replay_length, paper_replay_length
from . import (active_params, decode_flops, kv_bytes_per_token, layer_costs, model_params,
               prefill_flops)

RATIO_LENGTHS = (4096, 16384, 65536, 131072, 524288, 1048576)


def report(cfg: ModelConfig, seq_len: int = 131072, counting: str = "causal",
           dtype: str | None = None, ratio_lengths=RATIO_LENGTHS) -> dict[str, Any]:
    """Everything the CLI prints, as a JSON-ready dict (keys in the order the JSON shows)."""
    per_layer, halves = _params_per_layer(cfg)
    out: dict[str, Any] = {
        "config": cfg.to_dict(),
        "counting": counting,
        "seq_len": seq_len,
        "params": model_params(cfg),
        "params_per_layer": per_layer,
        "active_params_per_layer": halves,
        "active_params_prefill": None,
        "active_params_decode": None,
    }
    act = active_params(cfg)
    out["active_params_prefill"] = {"early_exited_token": act["early_exited_token"],
                                    "replayed_token": act["replayed_token"]}
    out["active_params_decode"] = act["decode_token"]
    out["active_params_breakdown"] = act
    kv = kv_bytes_per_token(cfg, dtype)
    out["global_kv_bytes_per_token"] = kv["global_kv_bytes_per_token"]
    out["kv"] = kv
    if cfg.has_decoder:
        out.update(_early_exit_report(cfg, seq_len, counting, ratio_lengths))
    else:
        out["prefill_flops"] = {"full": prefill_flops(cfg, seq_len, None, counting).as_dict()}
    out["decode_flops"] = decode_flops(cfg, seq_len, counting).as_dict()
    return out


def _params_per_layer(cfg: ModelConfig) -> tuple[list[dict], dict[str, dict]]:
    """The report's rows of parameters per layer (total and active, per component), and the
    mean, min and max active parameters per layer of each half."""
    layers = layer_costs(cfg)
    per_layer = [{"layer": lc.index, "part": lc.part, "global_mode": lc.global_mode,
                  "window": lc.window, "total": lc.total, "active": lc.active,
                  "components": {k: {"total": p.total, "active": p.active}
                                 for k, p in lc.components.items()}} for lc in layers]
    halves = {}
    for part in ("encoder", "decoder"):
        act = [lc.active for lc in layers if lc.part == part]
        if act:
            halves[part] = {"layers": len(act), "mean_active": sum(act) / len(act),
                            "min_active": min(act), "max_active": max(act)}
    return per_layer, halves


def _early_exit_report(cfg: ModelConfig, seq_len: int, counting: str,
                       ratio_lengths) -> dict[str, Any]:
    """The report's entries for a model with a decoder: the replay lengths, prefill FLOPs of the
    full forward and of early exit (replay = W and exact), their ratios at seq_len and against
    T, and the layer-count estimate of the ratio."""
    out: dict[str, Any] = {}
    out["exact_replay_length"] = exact_replay_length(cfg)
    out["paper_replay_length"] = paper_replay_length(cfg)
    out["bounded_replay_length"] = cfg.window
    modes = {"full": None, "replay_window": cfg.window, "replay_exact": "exact"}
    flops = {name: prefill_flops(cfg, seq_len, r, counting).as_dict()
             for name, r in modes.items()}
    full = flops["full"]["total"]
    out["prefill_flops"] = flops
    out["prefill_flops_ratio"] = flops["replay_window"]["total"] / full
    out["prefill_flops_ratio_exact"] = flops["replay_exact"]["total"] / full
    no_index = lambda f: f["total"] - f["indexer"]   # noqa: E731
    out["prefill_flops_ratio_excluding_indexer"] = (no_index(flops["replay_window"])
                                                    / no_index(flops["full"]))
    curve = []
    for t in ratio_lengths:
        f_full = prefill_flops(cfg, t, None, counting)
        f_win = prefill_flops(cfg, t, cfg.window, counting)
        f_ex = prefill_flops(cfg, t, "exact", counting)
        curve.append({"T": t, "ratio_window": f_win.total / f_full.total,
                      "ratio_exact": f_ex.total / f_full.total,
                      "ratio_window_excluding_indexer":
                          (f_win.total - f_win.indexer) / (f_full.total - f_full.indexer),
                      "flops_full": f_full.total})
    out["prefill_flops_ratio_vs_T"] = curve
    out["layer_ratio_estimate"] = ((cfg.n_encoder_layers * seq_len
                                    + cfg.n_decoder_layers * cfg.window)
                                   / (cfg.n_layers * seq_len))
    return out


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}" if unit in "TB" else f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _fmt_flops(n: float) -> str:
    return f"{n:.3e}"


def _group_layers(rows: list[dict]) -> list[tuple[str, dict]]:
    """Consecutive layers with the same part, mode and component counts, merged."""
    groups: list[tuple[list[int], dict]] = []
    for row in rows:
        key = (row["part"], row["global_mode"], row["components"])
        if groups and (groups[-1][1]["part"], groups[-1][1]["global_mode"],
                       groups[-1][1]["components"]) == key:
            groups[-1][0].append(row["layer"])
        else:
            groups.append(([row["layer"]], row))
    return [(str(ix[0]) if len(ix) == 1 else f"{ix[0]}-{ix[-1]}", row) for ix, row in groups]


def render(rep: dict[str, Any]) -> str:
    """The readable table: one section per kind of cost, separated by blank lines."""
    sections = [_render_heading(rep), _render_params(rep), _render_active_params(rep)]
    if "exact_replay_length" in rep:
        sections.append(_render_replay_lengths(rep))
    sections.append(_render_prefill_flops(rep))
    if "prefill_flops_ratio" in rep:
        sections.append(_render_ratio_vs_T(rep))
    sections.append(_render_kv(rep))
    return "\n\n".join("\n".join(lines) for lines in sections)


def _aligned_table(header: list[str], rows: list[list]) -> list[str]:
    """Lines of a table indented by two spaces, every column right-aligned to its widest cell."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    return (["  " + "  ".join(h.rjust(w) for h, w in zip(header, widths))]
            + ["  " + "  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows])


def _render_heading(rep: dict[str, Any]) -> list[str]:
    """The model's shape and how FLOPs are counted."""
    cfg = rep["config"]
    return [f"CED cost model: variant {cfg['variant']}, {cfg['n_encoder_layers']}+"
            f"{cfg['n_decoder_layers']} layers, d_model {cfg['d_model']}, window "
            f"{cfg['window']}, topk {cfg['topk']}, vocab {cfg['vocab_size']}",
            f"FLOP counting: {rep['counting']} (matmul FLOPs, 2 per multiply-add); T = "
            f"{rep['seq_len']}"]


def _render_params(rep: dict[str, Any]) -> list[str]:
    """Active parameters per component of each run of alike layers, the per-half summary and
    the whole model's count."""
    lines = ["Parameters per layer (active = touched by one token; MoE: shared + routed top-k)"]
    comp_names = []
    for row in rep["params_per_layer"]:
        for k in row["components"]:
            if k not in comp_names:
                comp_names.append(k)
    header = ["layers", "part", "mode"] + comp_names + ["active", "total"]
    table = []
    for label, row in _group_layers(rep["params_per_layer"]):
        comps = row["components"]
        cells = [label, row["part"], row["global_mode"] or "-"]
        for k in comp_names:
            p = comps.get(k)
            cells.append("-" if p is None else _fmt_count(p["active"]))
        cells += [_fmt_count(row["active"]), _fmt_count(row["total"])]
        table.append(cells)
    lines += _aligned_table(header, table)
    lines.append("  (component columns show active parameters; 'total' includes every expert "
                 "and Engram table)")
    for part, h in rep["active_params_per_layer"].items():
        lines.append(f"  {part}: mean active per layer {_fmt_count(h['mean_active'])} "
                     f"(min {_fmt_count(h['min_active'])}, max {_fmt_count(h['max_active'])})")
    p = rep["params"]
    lines.append(f"  whole model: {_fmt_count(p['total'])} parameters (embedding "
                 f"{_fmt_count(p['embedding'])}, LM head {_fmt_count(p['lm_head'])})")
    return lines


def _render_active_params(rep: dict[str, Any]) -> list[str]:
    """Active parameters per token in prefill (early-exited and replayed) and in decode."""
    a = rep["active_params_breakdown"]
    lines = ["Active parameters per token"]
    if "exact_replay_length" in rep:
        lines.append(f"  prefill, early-exited token : {_fmt_count(a['early_exited_token'])}  "
                     f"(embedding {_fmt_count(a['embedding'])} + encoder layers "
                     f"{_fmt_count(a['encoder_layers'])} + decoder KV source "
                     f"{_fmt_count(a['decoder_source'])})")
        lines.append(f"  prefill, replayed token     : {_fmt_count(a['replayed_token'])}  "
                     f"(+ decoder layers {_fmt_count(a['decoder_layers'])})")
    else:
        lines.append(f"  prefill token (no early exit): {_fmt_count(a['replayed_token'])}  "
                     f"(embedding {_fmt_count(a['embedding'])} + layers "
                     f"{_fmt_count(a['encoder_layers'])})")
    lines.append(f"  decode token                : {_fmt_count(a['decode_token'])}  (+ LM head "
                 f"{_fmt_count(a['lm_head'])})")
    return lines


def _render_replay_lengths(rep: dict[str, Any]) -> list[str]:
    """The exact, the paper's and the bounded replay length (models with a decoder)."""
    return ["Replay lengths",
            f"  R_exact = L_d * (W - 1) + 1 = {rep['exact_replay_length']}; the paper's "
            f"rounding L_d * W = {rep['paper_replay_length']}; bounded replay = W = "
            f"{rep['bounded_replay_length']}"]


def _render_prefill_flops(rep: dict[str, Any]) -> list[str]:
    """Prefill FLOPs per kind of work for each mode, and decode at T; with a decoder, the
    early-exit ratio beside the layer-count estimate."""
    t = rep["seq_len"]
    kinds = ["linear", "sources", "window_attention", "global_attention", "indexer", "head",
             "total"]
    header = ["mode"] + kinds + ["/ full"]
    table = []
    full = rep["prefill_flops"]["full"]["total"]
    for name, f in rep["prefill_flops"].items():
        table.append([name] + [_fmt_flops(f[k]) for k in kinds] + [f"{f['total'] / full:.4f}"])
    f = rep["decode_flops"]
    table.append([f"decode @{t}"] + [_fmt_flops(f[k]) for k in kinds] + [""])
    lines = [f"Prefill FLOPs at T = {t}"] + _aligned_table(header, table)
    if "prefill_flops_ratio" in rep:
        lines.append(f"  early exit (replay = W) / full = {rep['prefill_flops_ratio']:.4f}; "
                     f"without the indexer term "
                     f"{rep['prefill_flops_ratio_excluding_indexer']:.4f}; layer-count "
                     f"estimate (L_e T + L_d W) / (L T) = {rep['layer_ratio_estimate']:.4f}")
    return lines


def _render_ratio_vs_T(rep: dict[str, Any]) -> list[str]:
    """The early-exit prefill FLOP ratio at each length of the report's curve."""
    lines = ["Prefill FLOP ratio against T (early exit / full)",
             "         T   replay=W  replay=W excl. indexer  replay=exact   full FLOPs"]
    for row in rep["prefill_flops_ratio_vs_T"]:
        lines.append(f"  {row['T']:>8}   {row['ratio_window']:.4f}  "
                     f"{row['ratio_window_excluding_indexer']:>22.4f}  "
                     f"{row['ratio_exact']:>12.4f}   {row['flops_full']:.3e}")
    return lines


def _render_kv(rep: dict[str, Any]) -> list[str]:
    """KV cache storage: formats, bytes per global entry and per source, window and
    full-causal KV."""
    kv = rep["kv"]
    lines = ["KV cache",
             f"  formats: window {kv['formats']['window_kv']}, global "
             f"{kv['formats']['global_kv']}, indexer key {kv['formats']['indexer_key']}"]
    e = kv["entry_bytes"]
    if kv["sources"]:
        lines.append(f"  global entry: {e['main']} B main KV + {e['indexer_key']} B indexer "
                     f"key = {e['total']} B")
    for s in kv["sources"]:
        origin = (f"layer {s['from_layer']}" if s["from_layer"] is not None
                  else "RMSNorm(H_Le)")
        lines.append(f"  source {s['source']} ({s['part']}, from {origin}): ratio "
                     f"{s['compress_ratio']}, {s['entries_per_token']:g} entries/token, "
                     f"{s['bytes_per_token']:g} B/token")
    lines.append(f"  global KV: {kv['global_entries_per_token']:g} entries/token, "
                 f"{kv['global_kv_bytes_per_token']} B/token")
    held = [w for w in kv["window_kv_per_layer"] if "bytes" in w]
    if held:
        lines.append(f"  window KV: {kv['window_position_bytes']} B/position; "
                     f"{held[0]['positions']} positions held per layer between steps = "
                     f"{held[0]['bytes']} B/layer; {len(held)} window layers = "
                     f"{kv['window_kv_bytes_all_layers']} B per sequence")
    causal = [w for w in kv["window_kv_per_layer"] if "bytes_per_token" in w]
    if causal:
        lines.append(f"  full-causal KV: {kv['window_position_bytes']} B/position in each of "
                     f"{len(causal)} layers = {len(causal) * kv['window_position_bytes']} B "
                     f"per token")
    return lines
