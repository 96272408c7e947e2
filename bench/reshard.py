"""The train -> generate transition on 8 gloo ranks, four layouts x three schemes, side by side: bytes each rank
received (measured) against the paper's formula, generation-time parameter memory, transient peak, and time.
Usage: python bench/reshard.py [--layers 8] [--hidden 768] [--repeat 3] [--bucket-mb 4]   (288 MB of fp32 weights
by default). A cell's time is the slowest rank's, median over --repeat transitions.

Each layout also runs the actor's own transition (`actor` row: engines.bridge.reshard.gather_micro_dp, or
gather_stages where pipeline stages join, over megatron-named shards of a model of the same layers and width, plus
its embedding: ~6% more bytes than the schemes' model), checked bit for bit; its bytes are the mean over ranks (the
first stage also trains the embedding, so stages receive unequal shares), its time ratio is against the
DeepSpeed-Chat-style gather of the (smaller) schemes' model."""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the baselines and the harness are test support (tests/support/)

from support.reshard_baselines import comm_fraction, decoder_specs, model_bytes, peak_memory_fraction  # noqa: E402
from support.reshard_harness import SCHEMES, megatron_weights, run_megatron_gather, run_transition  # noqa: E402

from hybridflow.engines.bridge.layout import Layout  # noqa: E402
from hybridflow.engines.bridge.reshard import BUCKET_BYTES  # noqa: E402

LAYOUTS = {
    "t=4,p=1,d=2 -> t_g=2": Layout(p=1, t=4, d=2, p_g=1, t_g=2),
    "t=2,p=2,d=2 -> t_g=2,p_g=1": Layout(p=2, t=2, d=2, p_g=1, t_g=2),
    "t=8 -> t_g=2": Layout(p=1, t=8, d=1, p_g=1, t_g=2),
    "t=4,p=2,d=1 -> t_g=2,p_g=1": Layout(p=2, t=4, d=1, p_g=1, t_g=2),
}
MB = 1 << 20


def measure(L: Layout, scheme: str, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(bytes received, median seconds, generation bytes, transient peak bytes) of one cell; the first transition
    also checks every rank's generation weights against the model."""
    runs = [run_transition(L, scheme, args.layers, args.hidden, verify=(i == 0), bucket_bytes=int(args.bucket_mb * MB))
            for i in range(args.repeat)]
    assert all(r["ok"] for r in runs[0]), f"{L} {scheme}: generation weights differ from the model"
    secs = statistics.median(max(r["seconds"] for r in run) for run in runs)
    first = runs[0]
    return (max(r["bytes_received"] for r in first), secs, max(r["generation_bytes"] for r in first),
            max(r["peak_transient_bytes"] for r in first))


def measure_actor(L: Layout, args: argparse.Namespace) -> tuple[float, float, float, float]:
    """(mean bytes received, median seconds, generation bytes, transient peak bytes) of the actor's transition."""
    runs = [run_megatron_gather(L, int(args.bucket_mb * MB), args.hidden, args.layers, "float32")
            for _ in range(args.repeat)]
    assert all(r["ok"] for run in runs for r in run), f"{L} actor: generation shards differ from the model"
    secs = statistics.median(max(r["seconds"] for r in run) for run in runs)
    first = runs[0]
    return (statistics.mean(r["bytes_received"] for r in first), secs, max(r["generation_bytes"] for r in first),
            max(r["peak_transient_bytes"] for r in first))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=1, help="transitions per cell; the median time is shown")
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_BYTES / MB,
                    help="bytes of a rank's shards per HybridFlow all-gather (MB)")
    args = ap.parse_args()
    M = model_bytes(decoder_specs(args.layers, args.hidden))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {M / MB:.0f} MB fp32; 8 ranks on gloo; "
          f"hybridflow buckets {args.bucket_mb:g} MB; times: median of {args.repeat} (slowest rank each)\n")
    head = (f"{'layout':<28}{'scheme':<16}{'recv MB/rank':>13}{'formula MB':>11}{'err %':>7}"
            f"{'gen MB':>8}{'peak MB':>9}{'time s':>8}{'time vs HF':>11}")
    print(head)
    print("-" * len(head))
    M_actor = sum(t.numel() * t.element_size() for t in megatron_weights(args.hidden, args.layers, "float32").values())
    speedups, actor_speedups = {}, {}
    for name, L in LAYOUTS.items():
        rows = {scheme: measure(L, scheme, args) for scheme in SCHEMES}
        base = rows["hybridflow"][1]
        for scheme, (recv, secs, gen, peak) in rows.items():
            formula = float(comm_fraction(L, scheme)) * M
            err = 100 * (recv - formula) / formula if formula else 0.0
            print(f"{name:<28}{scheme:<16}{recv / MB:>13.1f}{formula / MB:>11.1f}{err:>7.2f}"
                  f"{gen / MB:>8.0f}{peak / MB:>9.1f}{secs:>8.3f}{secs / base:>10.2f}x")
        speedups[name] = rows["deepspeed-chat"][1] / base
        recv, secs, gen, peak = measure_actor(L, args)
        formula = float(comm_fraction(L, "hybridflow")) * M_actor
        err = 100 * (recv - formula) / formula if formula else 0.0
        print(f"{name:<28}{'actor':<16}{recv / MB:>13.1f}{formula / MB:>11.1f}{err:>7.2f}"
              f"{gen / MB:>8.0f}{peak / MB:>9.1f}{secs:>8.3f}{secs / base:>10.2f}x")
        actor_speedups[name] = rows["deepspeed-chat"][1] / secs
        fraction = peak_memory_fraction(L, "hybridflow")
        print(f"{'':<28}hybridflow vs deepspeed-chat: {speedups[name]:.2f}x (median of {args.repeat})")
        print(f"{'':<28}(memory formula: HybridFlow M/(t_g p_g) = {fraction} M = {float(fraction) * M / MB:.0f} MB)")
    worst = min(speedups, key=speedups.get)
    print(f"\nhybridflow vs deepspeed-chat, median of {args.repeat}: {min(speedups.values()):.2f}x to "
          f"{max(speedups.values()):.2f}x; slowest layout: {worst}")
    worst = min(actor_speedups, key=actor_speedups.get)
    print(f"the actor's transition vs deepspeed-chat: {min(actor_speedups.values()):.2f}x to "
          f"{max(actor_speedups.values()):.2f}x; slowest layout: {worst}")
    print("peak MB: what a scheme holds beyond its generation weights (hybridflow: one bucket; tensors gathered "
          "straight into\ntheir generation tensor add nothing). gloo also holds its own copy of each all-gather's "
          "output while it runs, in every scheme.")


if __name__ == "__main__":
    main()
