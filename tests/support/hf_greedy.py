"""After a weight sync, the rollout engine generates what plain HF generates with the trained weights (greedy):
shared by tests/trainer/test_weight_sync.py and tests/trainer/test_async_rollout.py."""
from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.checkpoint import CheckpointRoot, checkpointer
from hybridflow.data.packing import unpack_responses
from hybridflow.data.tasks import PromptStream
from hybridflow.export import role_weights
from hybridflow.single_controller.worker_group import resolve
from hybridflow.trainer import task as tasks
from hybridflow.trainer.step import AlgorithmState


def hf_greedy(hf, prompt: list[int], response: list[int]) -> list[int]:
    """HF's greedy token after the prompt and after each prefix of `response`, in one teacher-forced forward pass.
    It equals `response` exactly when HF's greedy decoding of len(response) tokens is `response` (each token is
    the argmax given the ones before it), as `hf.generate(do_sample=False, min_new_tokens=len(response))` would
    decode it, one forward per token: like min_new_tokens, end-of-sequence is never chosen."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():  # the LM head only where a response token is chosen
        out = hf(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=len(response) + 1)
    logits = out.logits[0, :-1].float()
    if hf.generation_config.eos_token_id is not None:
        logits[:, hf.generation_config.eos_token_id] = float("-inf")
    return logits.argmax(-1).tolist()


def assert_greedy_matches_hf(job, w, task, model_dir, step):
    """Save a checkpoint, load its actor weights into plain HF, and compare greedy responses on held-out prompts.
    HF runs in the dtype the actor generates in (the megatron engine: its weights' dtype, whatever computeDtype)."""
    from transformers import AutoModelForCausalLM

    root = CheckpointRoot(Path(job.spec.trainer.checkpoint_dir))
    saved = checkpointer.save(job, w, root, step, PromptStream(task.train, 8, 0), AlgorithmState.for_spec(job.spec))
    state = role_weights(saved, "actor")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, w.roles["rollout"].generation_dtype_name()))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    hf.eval()
    held_out = task.eval[:8]
    got = unpack_responses(resolve(w.roles["rollout"].generate(tasks.prompt_batch(held_out), greedy=True)))
    assert len(got) == len(held_out)
    for sample, resp in zip(held_out, got, strict=True):
        assert resp == hf_greedy(hf, sample.prompt, resp)
