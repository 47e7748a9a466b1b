#!/usr/bin/env python3
"""Summarize `kvcredit divergence run` folders (reads the Parquet tables only).

Prints, per run × dtype × strategy: problems, divergence rate (Wilson 95%), median τ,
accuracy ON / OFF with churn (ON-only / OFF-only correct) and the exact McNemar p; per dtype the
teacher-forced metrics (max |Δlogit|, mean MSE, mean KL, flip rate, median margin at flips) and
their fp16/fp32 and bf16/fp32 ratios; the layer of largest mean residual drift; patch recovery
per layer set; and live-vs-replay / transplant donor-following. With ``--json`` writes the same
numbers as JSON.

    python notebooks/divergence_summary.py runs/divergence-cpu-smollm2 [more runs] [--json out.json]
"""
import argparse
import json
import math
import os

import pyarrow.parquet as pq


def wilson(k, n, z=1.96):
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


def mcnemar_exact(b, c):
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * p)


def load(run, name):
    path = os.path.join(run, f"{name}.parquet")
    return pq.read_table(path).to_pandas() if os.path.exists(path) else None


def summarize(run):
    out = {"run": run, "pairs": [], "forced": [], "drift": [], "patches": [], "replay": []}
    pairs = load(run, "pairs")
    for (dtype, strat), g in pairs.groupby(["dtype", "strategy"], sort=False):
        n, k = len(g), int(g.diverged.sum())
        taus = g.tau.dropna()
        b = int((g.correct_on & ~g.correct_off).sum())
        c = int((~g.correct_on & g.correct_off).sum())
        out["pairs"].append({
            "dtype": dtype, "strategy": strat, "problems": n, "diverged": k, "rate": k / n,
            "rate_ci95": wilson(k, n), "tau_median": float(taus.median()) if len(taus) else None,
            "acc_on": float(g.correct_on.mean()), "acc_off": float(g.correct_off.mean()),
            "on_only": b, "off_only": c, "mcnemar_p": mcnemar_exact(b, c)})
    forced = load(run, "forced")
    if forced is not None:
        for dtype, g in forced.groupby("dtype", sort=False):
            flips = g[g.flip]
            out["forced"].append({
                "dtype": dtype, "steps": len(g), "max_abs": float(g.max_abs.max()),
                "mean_max_abs": float(g.max_abs.mean()), "mse": float(g.mse.mean()),
                "kl": float(g.kl_off_on.mean()), "flip_rate": float(g.flip.mean()),
                "flips": int(len(flips)),
                "flip_margin_median": float(flips.margin_off.median()) if len(flips) else None})
        ref = {r["dtype"]: r for r in out["forced"]}.get("fp32")
        for r in out["forced"]:
            if ref and r["dtype"] != "fp32":
                for m in ("max_abs", "mean_max_abs", "mse", "kl"):
                    r[f"{m}_ratio_vs_fp32"] = r[m] / ref[m] if ref[m] > 0 else float("inf")
    drift = load(run, "drift")
    if drift is not None:
        for dtype, g in drift.groupby("dtype", sort=False):
            per_layer = g.groupby("layer")[["resid_rel", "k_rel", "v_rel"]].mean()
            out["drift"].append({"dtype": dtype, "per_layer": per_layer.reset_index().to_dict("list"),
                                 "argmax_resid_layer": int(per_layer.resid_rel.idxmax())})
    patches = load(run, "patches")
    if patches is not None and len(patches):
        for (dtype, label), g in patches.groupby(["dtype", "label"], sort=False):
            out["patches"].append({"dtype": dtype, "label": label, "problems": len(g),
                                   "recovery_mean": float(g.recovery.mean()),
                                   "prefers_off": float((g.m > 0).mean()),
                                   "follow_off": float(g.follow_off.mean()),
                                   "off_prefix_mean": float(g.off_prefix.mean())})
    replay = load(run, "replay")
    if replay is not None and len(replay):
        for keys, g in replay.groupby(["dtype", "kind", "chunk", "direction", "parts", "layer_start", "layer_end"], sort=False):
            out["replay"].append({"dtype": keys[0], "kind": keys[1], "chunk": int(keys[2]),
                                  "direction": keys[3], "parts": keys[4], "layers": [int(keys[5]), int(keys[6])],
                                  "states": len(g), "replica_equal": float(g.replica_equal.mean()),
                                  "k_max_abs": float(g.k_max_abs.max()), "v_max_abs": float(g.v_max_abs.max()),
                                  "follows_live": float(g.follows_live.mean()),
                                  "follows_replay": float(g.follows_replay.mean())})
    return out


def show(s):
    print(f"== {s['run']}")
    print(f"{'dtype':5} {'strategy':20} {'n':>4} {'diverged':>9} {'rate (95% CI)':>22} {'τ med':>6} {'acc ON':>7} {'acc OFF':>7} {'ON/OFF-only':>11} {'McNemar p':>9}")
    for r in s["pairs"]:
        lo, hi = r["rate_ci95"]
        tau = "-" if r["tau_median"] is None else f"{r['tau_median']:.0f}"
        print(f"{r['dtype']:5} {r['strategy']:20} {r['problems']:4} {r['diverged']:9} {r['rate']:8.2f} [{lo:.2f}, {hi:.2f}]  {tau:>6} "
              f"{r['acc_on']:7.2f} {r['acc_off']:7.2f} {r['on_only']:5}/{r['off_only']:<5} {r['mcnemar_p']:9.3f}")
    for r in s["forced"]:
        ratio = "".join(f" {m}×{r[m + '_ratio_vs_fp32']:.3g}" for m in ("max_abs", "mse", "kl") if m + "_ratio_vs_fp32" in r)
        fm = "-" if r["flip_margin_median"] is None else f"{r['flip_margin_median']:.3g}"
        print(f"teacher-forced {r['dtype']}: {r['steps']} steps, max|Δ| {r['max_abs']:.3e}, mean max|Δ| {r['mean_max_abs']:.3e}, "
              f"MSE {r['mse']:.3e}, KL {r['kl']:.3e}, flips {r['flips']} ({100 * r['flip_rate']:.2f}%), median margin at flips {fm};{ratio} vs fp32")
    for r in s["drift"]:
        print(f"drift {r['dtype']}: residual drift peaks at layer {r['argmax_resid_layer']}; per layer mean rel: "
              + " ".join(f"{x:.1e}" for x in r["per_layer"]["resid_rel"]))
    for r in s["patches"]:
        print(f"patch {r['dtype']} {r['label']:>8}: n={r['problems']}, recovery {r['recovery_mean']:+.3f}, "
              f"z[y_OFF] > z[y_ON] in {r['prefers_off']:.2f}, follow OFF {r['follow_off']:.2f}, OFF-prefix {r['off_prefix_mean']:.1f}")
    for r in s["replay"]:
        print(f"replay {r['dtype']} {r['kind']:10} chunk {r['chunk']:4} {r['direction']:13} {r['parts']:2} layers {r['layers']}: "
              f"n={r['states']}, replica= {r['replica_equal']:.2f}, max|ΔK| {r['k_max_abs']:.2e}, max|ΔV| {r['v_max_abs']:.2e}, "
              f"follows live {r['follows_live']:.2f}, follows replay {r['follows_replay']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    all_ = [summarize(r) for r in a.runs]
    for s in all_:
        show(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_, f, indent=1, default=float)


if __name__ == "__main__":
    main()
