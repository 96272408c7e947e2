"""The train -> generate transition on 8 gloo ranks, three layouts x three schemes, side by side: bytes each rank
received (measured) against the paper's formula, generation-time parameter memory, transient peak, and time.
Usage: python bench/reshard.py [--layers 8] [--hidden 1024]   (about 290 MB of fp32 weights by default)"""
from __future__ import annotations

import argparse
import statistics

from hybridflow.hybrid_engine.harness import SCHEMES, run_transition
from hybridflow.hybrid_engine.layout import Layout, comm_fraction, peak_memory_fraction
from hybridflow.hybrid_engine.reshard import decoder_specs, model_bytes

LAYOUTS = {
    "t=4,p=1,d=2 -> t_g=2": Layout(p=1, t=4, d=2, p_g=1, t_g=2),
    "t=2,p=2,d=2 -> t_g=2,p_g=1": Layout(p=2, t=2, d=2, p_g=1, t_g=2),
    "t=8 -> t_g=2": Layout(p=1, t=8, d=1, p_g=1, t_g=2),
}
MB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=1, help="transitions per cell; the median time is shown")
    args = ap.parse_args()
    M = model_bytes(decoder_specs(args.layers, args.hidden))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {M / MB:.0f} MB fp32; 8 ranks on gloo\n")
    head = (f"{'layout':<28}{'scheme':<16}{'recv MB/rank':>13}{'formula MB':>11}{'err %':>7}"
            f"{'gen MB':>8}{'peak MB':>9}{'time s':>8}{'time vs HF':>11}")
    print(head)
    print("-" * len(head))
    for name, L in LAYOUTS.items():
        rows = {}
        for scheme in SCHEMES:
            runs = [run_transition(L, scheme, args.layers, args.hidden, verify=(i == 0)) for i in range(args.repeat)]
            assert all(r["ok"] for r in runs[0]), f"{name} {scheme}: generation weights differ from the model"
            recv = max(r["bytes_received"] for r in runs[0])
            secs = statistics.median(max(r["seconds"] for r in run) for run in runs)
            rows[scheme] = (recv, secs, max(r["generation_bytes"] for r in runs[0]),
                            max(r["peak_transient_bytes"] for r in runs[0]))
        base = rows["hybridflow"][1]
        for scheme, (recv, secs, gen, peak) in rows.items():
            formula = float(comm_fraction(L, scheme)) * M
            err = 100 * (recv - formula) / formula if formula else 0.0
            print(f"{name:<28}{scheme:<16}{recv / MB:>13.1f}{formula / MB:>11.1f}{err:>7.2f}"
                  f"{gen / MB:>8.0f}{peak / MB:>9.0f}{secs:>8.3f}{secs / base:>10.2f}x")
        print(f"{'':<28}{'(memory formula: HybridFlow M/(t_g p_g) = ' + str(peak_memory_fraction(L, 'hybridflow')) + ' M)'}")


if __name__ == "__main__":
    main()
