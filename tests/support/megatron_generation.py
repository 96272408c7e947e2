"""`python -m support.megatron_generation SHAPE_JSON`: the megatron generation engine (engines.rollout.megatron) in
one process (gloo, world 1, TP 1) on a decoder with random weights; prints JSON: each response, the greedy choice
of a plain full forward over prompt + response at every position (teacher forcing: what the engine must have
chosen), and the seconds of short and long generations. A process of its own: torch.distributed and megatron's
parallel state stay out of the test runner."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def main(spec: dict) -> dict:
    from megatron.core import parallel_state as ps

    from hybridflow.engines.rollout.base import SamplingConfig
    from hybridflow.engines.rollout.megatron import MegatronRollout
    from hybridflow.engines.train import megatron_model as mm
    from hybridflow.engines.train.megatron import attention_inputs, init_model_parallel

    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1)
    try:
        init_model_parallel(tp=1)  # the training engine's own set-up (CPU fallbacks, megatron's RNG tracker)
        torch.manual_seed(0)
        shape = mm.DecoderShape(**spec["shape"])
        reference = mm.build_gpt(mm.transformer_config(shape, torch.float32, tp=1, pp=1), shape).eval()
        with torch.no_grad():  # megatron's init (std 0.02) makes a model that repeats its last token: livelier
            for name, p in reference.named_parameters():
                if "layernorm" not in name:
                    p.mul_(spec.get("weight_scale", 1.0))
        weights = {k: v.detach().clone() for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
        engine = MegatronRollout(shape, "float32", dist.group.WORLD, [0], seed=0, device=torch.device("cpu"))
        engine.load_weights([(k, weights[k]) for k in engine.shapes])
        prompts = spec["prompts"]

        def run(n: int) -> tuple[list[list[int]], float]:
            # CPU seconds of this process, not wall-clock ones: what the generation costs, whatever else the
            # machine runs beside it (the slow tests run beside the e2e scenarios)
            t0 = time.process_time()
            got = engine.generate(prompts, [SamplingConfig(max_tokens=n, greedy=True)] * len(prompts))
            return [g.tokens for g in got], time.process_time() - t0

        run(4)  # warm-up: first-call costs out of the timings
        responses, _ = run(spec["check_tokens"])
        forced = []
        with torch.no_grad():
            for prompt, resp in zip(prompts, responses):
                ids = torch.tensor([prompt + resp])
                x, pos, mask = attention_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
                logits = reference(x, pos, attention_mask=mask)[0].float()
                forced.append(logits[len(prompt) - 1:-1].argmax(-1).tolist())
        timings = {str(n): min(run(n)[1] for _ in range(2)) for n in spec["lengths"]}
        return {"responses": responses, "forced": forced, "seconds": timings}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(main(json.loads(sys.argv[1]))))
