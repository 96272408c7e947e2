"""`python -m support.megatron_generation SHAPE_JSON`: the megatron generation engine (engines.rollout.megatron) in
one process (gloo, world 1, TP 1) on a decoder with random weights; prints JSON: each response, the greedy choice
of a plain full forward over prompt + response at every position (teacher forcing: what the engine must have
chosen), and the number of tokens each forward pass of the generation was fed. A process of its own: torch.distributed and megatron's
parallel state stay out of the test runner."""
from __future__ import annotations

import json
import os
import sys
import tempfile

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

        fed: list[int] = []  # the sequence length of every forward pass the engine makes
        hook = engine.model.register_forward_pre_hook(lambda _m, args: fed.append(int(args[0].shape[1])))
        got = engine.generate(prompts, [SamplingConfig(max_tokens=spec["check_tokens"], greedy=True)] * len(prompts))
        hook.remove()
        responses = [g.tokens for g in got]
        forced = []
        with torch.no_grad():
            for prompt, resp in zip(prompts, responses):
                ids = torch.tensor([prompt + resp])
                x, pos, mask = attention_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
                logits = reference(x, pos, attention_mask=mask)[0].float()
                forced.append(logits[len(prompt) - 1:-1].argmax(-1).tolist())
        return {"responses": responses, "forced": forced, "fed": fed}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(main(json.loads(sys.argv[1]))))
