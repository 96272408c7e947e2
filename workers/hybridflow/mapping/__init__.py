"""The paper's device mapping (HybridFlow, section 6, Algorithm 1): enumerate placements of a job's models onto
pools, the pools' device counts, the training and generation layouts and micro-batch sizes; drop what the memory
model refuses; score the rest with a stage-time model; rank. `hybridflow plan JOB --devices N --accelerator X`
prints the ranking and writes the chosen resolved spec.

Pure: a parsed job, the models' shapes and a device profile in, ranked resolved specs out. The modules, one job
each: workload (what one step does), candidates (what may be tried), stage_time (the simulator), fit (the memory
model per pool, fast), resolve (a candidate as a JobSpec), search (the ranking), paper (the paper's setups)."""
from hybridflow.mapping.candidates import MODES, Candidate, Layout, Placement, enumerate_candidates
from hybridflow.mapping.resolve import placement_label, resolve
from hybridflow.mapping.search import PlanError, Ranked, SearchResult, render_ranking, search
from hybridflow.mapping.stage_time import Calibration

__all__ = ["MODES", "Calibration", "Candidate", "Layout", "PlanError", "Placement", "Ranked", "SearchResult",
           "enumerate_candidates", "placement_label", "render_ranking", "resolve", "search"]
