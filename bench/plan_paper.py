"""The planner against the paper (issue 52, item 5): for the HybridFlow paper's PPO setups (actor, critic,
reference and reward of one size; 16 to 128 A100-80GB; synchronous, as the paper's system is; megatron training
beside the generation engine, as the paper's), the planner's first choice next to the placement the paper's
placement study reports best (hybridflow.mapping.paper.REPORTED: recalled, not re-read; "-": the study does not
cover that size). Pure and fast (no devices):

    .venv/bin/python bench/plan_paper.py
"""
from __future__ import annotations

import time

from hybridflow.api.devices import PROFILES
from hybridflow.mapping import search
from hybridflow.mapping.paper import DEVICES, LLAMA, REPORTED, PaperRow, paper_job, paper_shapes


def rows() -> list[PaperRow]:
    out = []
    device = PROFILES["a100-80gb"]
    for size in LLAMA:
        for n in DEVICES:
            result = search(paper_job(size), paper_shapes(size), n, device, top=1, modes=("sync",),
                            engines=("megatron",))
            reported = REPORTED.get((size, n), "-")
            if not result.ranked:
                out.append(PaperRow(size, n, "none fits", "-", float("nan"), reported))
                continue
            best = result.ranked[0]
            out.append(PaperRow(size, n, best.label, best.candidate.layout.describe(), best.step_seconds, reported))
    return out


def main() -> None:
    started = time.perf_counter()
    table = rows()
    print("The 'paper (recalled)' column is what we remember of the paper's placement comparison (section 8), not "
          "checked against its text: check it before quoting it.\n")
    print("| model | A100s | planner's pick | layout | predicted step s | paper (recalled) | agrees |")
    print("|---|---:|---|---|---:|---|---|")
    for r in table:
        print(f"| {r.size} | {r.devices} | {r.pick} | {r.layout} | {r.step_seconds:.1f} | {r.reported} | "
              f"{r.agrees} |")
    print(f"\n{len(table)} setups planned in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
