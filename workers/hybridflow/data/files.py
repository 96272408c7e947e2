"""Prompt sets from the user's files (JSONL, JSON, Parquet, or a `datasets.save_to_disk` directory) via HF `datasets`.

verl's layout loads unchanged: `prompt` as chat messages, the ground truth at `reward_model.ground_truth`, and
`data_source` and `extra_info` handed to the reward function. Prompts are rendered with the model's chat template
and tokenized once: the token ids are a `datasets` map cached under a fingerprint of the data, the prompt column,
the template, the system prompt and the tokenizer, so a restarted job (or the next job on the same files) reads them
back instead of tokenizing again. Rows are read lazily by index, so a large set never sits in Python lists.
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, overload

from hybridflow.agents.toolcalls import plain_tools_text, template_renders_tools
from hybridflow.data.holdout import ROW_ID_KEYS, HeldOut, hold_out
from hybridflow.data.tasks import Sample
from hybridflow.api import DATA_MOUNT, Data, SpecError
from hybridflow.api.storage import is_url

if TYPE_CHECKING:
    from hybridflow.api import JobSpec

log = logging.getLogger("hybridflow.data")

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # file suffix -> datasets builder
IDS, LENGTH, DIGEST = "_hybridflow_prompt_ids", "_hybridflow_prompt_length", "_hybridflow_prompt_digest"
NULL_PROMPT = -1  # LENGTH of a row whose prompt is null: skipped and counted
_CACHE_VERSION = "1"  # bump when the encoding below changes, so old cache files are not read back
_GLOB = re.compile(r"[*?\[]")


class DataError(SpecError):
    """Bad prompt data; the message names the spec field or the file, and what to do."""


# ---------------------------------------------------------------------------------------------------------------------
# Files


def _saved_dataset(d: Path) -> bool:
    return (d / "state.json").is_file() or (d / "dataset_dict.json").is_file()


def job_private_paths(spec: "JobSpec") -> tuple[str, ...]:
    """What an agent's tools and environments must not read of the job's own: its prompt files (a glob as the files
    it matches: its directory may hold the user's tool code), the volume they are on in a pod, and its checkpoints
    (step log, rollout log). A tool the model calls would find there the answers it is scored on. Absolute paths
    of this process's view; object storage is out of a sandbox's reach already (no network)."""
    d = spec.data
    out: list[str] = []
    for entry in (*d.train, *d.eval):
        out += glob.glob(entry, recursive=True) if _GLOB.search(entry) else [entry]
    if spec.kubernetes.data_pvc:
        out.append(DATA_MOUNT)
    out += [p for p in (spec.trainer.checkpoint_dir, spec.trainer.resume_from) if p and not is_url(p)]
    return tuple(sorted({os.path.abspath(p) for p in out}))


def resolve_paths(field: str, entries: Sequence[str]) -> tuple[str, list[Path]]:
    """The datasets builder ('json', 'parquet', or 'disk' for a save_to_disk directory) and the files of a list of
    files, globs and directories. Cheap (no file is read), so it runs before Ray starts."""
    files: list[Path] = []
    saved: list[Path] = []
    for entry in entries:
        p = Path(entry)
        if _GLOB.search(entry):
            found = sorted(Path(x) for x in glob.glob(entry, recursive=True) if Path(x).is_file())
            if not found:
                raise DataError(f"{field}: the pattern '{entry}' matches no file{_relative(p)}")
            files += found
        elif p.is_dir():
            if _saved_dataset(p):
                saved.append(p)
                continue
            found = sorted(x for x in p.rglob("*") if x.is_file() and x.suffix in BUILDERS
                           and not any(part.startswith(".") for part in x.relative_to(p).parts))
            if not found:
                raise DataError(f"{field}: the directory '{entry}' holds no .jsonl, .json or .parquet file and is not "
                                "a directory written by datasets' save_to_disk")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"{field}: '{entry}' does not exist{_relative(p)}; fix the path")
    if saved:
        if len(saved) > 1 or files:
            raise DataError(f"{field}: a save_to_disk directory ('{saved[0]}') must be the only entry")
        return "disk", saved
    odd = [f for f in files if f.suffix not in BUILDERS]
    if odd:
        raise DataError(f"{field}: '{odd[0]}' is not a .jsonl, .json or .parquet file")
    builders = sorted({BUILDERS[f.suffix] for f in files})
    if len(builders) > 1:
        raise DataError(f"{field}: mixes JSON and Parquet files; give one format per set")
    return builders[0], files


def _relative(p: Path) -> str:
    return "" if p.is_absolute() else f" (relative to {Path.cwd()})"


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    return datasets


def load_table(field: str, entries: Sequence[str], cache_dir: Path) -> Any:
    """The rows of `entries` as a `datasets.Dataset`; unreadable files are a DataError naming them."""
    datasets = _quiet_datasets()
    kind, paths = resolve_paths(field, entries)
    where = ", ".join(f"'{p}'" for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    if kind != "disk" and all(p.stat().st_size == 0 for p in paths):
        raise DataError(f"{field}: {where} holds no rows (empty file)")
    try:
        if kind == "disk":
            ds = datasets.load_from_disk(str(paths[0]))
            if isinstance(ds, datasets.DatasetDict):
                wanted = ("train",) if field.endswith("train") else ("test", "validation")
                split = next((k for k in wanted if k in ds), None)
                if split is None:
                    raise DataError(f"{field}: {where} is a DatasetDict without a {' or '.join(map(repr, wanted))} "
                                    f"split (it has {', '.join(ds)}); point at one split's directory, e.g. "
                                    f"{paths[0]}/{next(iter(ds))}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train",
                                       cache_dir=str(cache_dir))
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow, json and datasets raise many types for a bad file
        cause = err.__cause__ or err
        if isinstance(cause, OSError) and str(cache_dir) in str(cause):
            raise  # the cache (disk full, read-only): not the data's fault, not exit 2
        if "corresponds to no data" in str(cause):  # datasets' words for files without a single row
            raise DataError(f"{field}: {where} holds no rows") from None
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise DataError(f"{field}: cannot read {where} as {kind}: {type(cause).__name__}: {text[:300]}; "
                        "check that the file is complete and in that format") from None
    if len(ds) == 0:
        raise DataError(f"{field}: {where} holds no rows")
    return ds


# ---------------------------------------------------------------------------------------------------------------------
# Columns


def column_names(features: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every column, nested ones as dotted paths ('reward_model', 'reward_model.ground_truth', ...)."""
    out = []
    for name, feature in features.items():
        out.append(prefix + name)
        if isinstance(feature, dict):
            out += column_names(feature, f"{prefix}{name}.")
    return out


def get_path(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def require_column(field: str, key: str, ds: Any, where: str) -> None:
    names = column_names(ds.features)
    if key not in names:
        raise DataError(f"{field}: {where} has no column '{key}'; columns found: {', '.join(names)}. Point the key "
                        "at one of them")


# ---------------------------------------------------------------------------------------------------------------------
# Rendering prompts


class PromptRenderer:
    """A prompt value (a string, or chat messages) -> token ids, through the chat template when there is one."""

    def __init__(self, tokenizer: Any, chat_template: str | None, system_prompt: str | None,
                 tools: Sequence[dict[str, Any]] = ()) -> None:
        """tools: offered to the model (multi-turn rollouts), in the OpenAI/HF function form: through the template's
        own `tools` rendering where it has one, else as the documented plain-text paragraph of the system message."""
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        self.tools = list(tools)
        self.template_tools = bool(self.tools) and template_renders_tools(self.template)
        if self.tools and not self.template_tools:
            system_prompt = "\n\n".join(x for x in (system_prompt, plain_tools_text(self.tools)) if x)
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.template_field = "spec.data.chatTemplate" if chat_template else "the model's chat template"
        try:
            self.ids([{"role": "user", "content": "2 + 2?"}], "a test prompt")
        except Exception as err:  # noqa: BLE001 - jinja raises several types
            raise DataError(f"{self.template_field}: cannot render a prompt: {type(err).__name__}: {err}") from None

    def messages(self, value: Any, where: str) -> list[dict[str, str]]:
        if isinstance(value, Mapping) and isinstance(value.get("role"), list) and isinstance(value.get("content"), list):
            value = [{"role": r, "content": c} for r, c in zip(value["role"], value["content"])]  # a Sequence feature
        if isinstance(value, str):
            msgs = [{"role": "user", "content": value}]
        elif isinstance(value, list) and value and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        ):
            msgs = [{"role": m["role"], "content": m["content"]} for m in value]
        else:
            raise DataError(f"{where}: a prompt must be a string or a list of chat messages {{role, content}}, got "
                            f"{type(value).__name__}: {str(value)[:120]}")
        if self.system_prompt is not None:
            msgs = [{"role": "system", "content": self.system_prompt}] + [m for m in msgs if m["role"] != "system"]
        return msgs

    def ids(self, value: Any, where: str) -> list[int]:
        msgs = self.messages(value, where)
        if self.template:
            extra = {"tools": self.tools} if self.template_tools else {}
            return list(self.tokenizer.apply_chat_template(msgs, chat_template=self.template, tokenize=True,
                                                           add_generation_prompt=True, return_dict=False, **extra))
        return list(self.tokenizer("\n\n".join(m["content"] for m in msgs))["input_ids"])

    def digest(self) -> str:
        """What the token ids depend on besides the data."""
        h = hashlib.sha256()
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else repr(sorted(self.tokenizer.get_vocab().items()))
        h.update(vocab.encode())
        h.update(repr((self.template, self.system_prompt, _CACHE_VERSION)).encode())
        if self.tools:
            h.update(repr(self.tools).encode())
        return h.hexdigest()


def tokenize(ds: Any, prompt_key: str, renderer: PromptRenderer, cache_dir: Path, field: str) -> Any:
    """The rows plus their prompt's token ids, length (NULL_PROMPT when the prompt is null) and a digest of the ids,
    from the cache when this data was tokenized this way before."""
    from datasets import Features, List, Value
    from datasets.fingerprint import Hasher

    root, _, rest = prompt_key.partition(".")
    fingerprint = Hasher.hash([ds._fingerprint, prompt_key, renderer.digest()])
    cache_dir.mkdir(parents=True, exist_ok=True)

    def encode(value: Any, index: int) -> dict[str, Any]:
        value = get_path({root: value}, prompt_key) if rest else value
        if value is None:
            return {IDS: [], LENGTH: NULL_PROMPT, DIGEST: ""}
        where = f"{field}: row {index}, column '{prompt_key}'"
        try:
            ids = renderer.ids(value, where)
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 - a template may reject a row (roles that do not alternate, ...)
            raise DataError(f"{where}: {renderer.template_field} cannot render it: {type(err).__name__}: {err}") \
                from None
        return {IDS: ids, LENGTH: len(ids), DIGEST: hashlib.blake2b(repr(ids).encode(), digest_size=12).hexdigest()}

    # Typed outputs: datasets would infer them from the first rows, and a run of null prompts there reads as nulls.
    features = Features({**ds.features, IDS: List(Value("int32")), LENGTH: Value("int32"), DIGEST: Value("string")})
    return ds.map(encode, input_columns=[root], with_indices=True, new_fingerprint=fingerprint, features=features,
                  cache_file_name=str(cache_dir / f"prompts-{fingerprint}.arrow"), desc="tokenizing prompts")


# ---------------------------------------------------------------------------------------------------------------------
# Samples


class FileSamples(Sequence[Sample]):
    """Rows of a tokenized dataset as Samples, read on access."""

    def __init__(self, ds: Any, rows: list[int], data: Data, default_source: str) -> None:
        self.ds, self.rows, self.data, self.default_source = ds, rows, data, default_source
        prompt_root = data.prompt_key.split(".")[0]
        answer_root = data.answer_key.split(".")[0] if data.answer_key else None
        self._not_extra = {IDS, LENGTH, DIGEST, prompt_root, answer_root, "data_source", "extra_info"}

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Sample: ...
    @overload
    def __getitem__(self, i: slice) -> list[Sample]: ...
    def __getitem__(self, i: int | slice) -> Sample | list[Sample]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.sample(self.ds[self.rows[i]])

    def sample(self, row: Mapping[str, Any]) -> Sample:
        """verl's reward arguments: data_source from its column (else the file's name), extra_info from its column
        merged over every column the prompt and answer do not use."""
        extra = {k: v for k, v in row.items() if k not in self._not_extra}
        if isinstance(row.get("extra_info"), Mapping):
            extra.update(row["extra_info"])
        truth = get_path(row, self.data.answer_key) if self.data.answer_key else None
        return Sample(list(row[IDS]), truth, str(row.get("data_source") or self.default_source), extra,
                      get_path(row, self.data.prompt_key))


@dataclass
class PromptFiles:
    train: FileSamples
    eval: FileSamples
    fingerprint: str  # of the training rows: a resumed job checks it still reads the same data


@dataclass(frozen=True)
class Usable:
    """A prompt file's rows with a prompt that fits (indices), and how many of all its rows were null or too long."""

    rows: list[int]
    total: int
    nulls: int
    long: int

    def short(self, max_len: int) -> str:
        """What the rows that cannot be used were, for the message that refuses too few."""
        return (f"of its {self.total} rows, {self.nulls} have a null prompt and {self.long} one longer than "
                f"spec.rollout.maxPromptLength = {max_len}")


def _usable_rows(ds: Any, field: str, max_len: int) -> Usable:
    """The rows with a prompt that fits; nulls are skipped and too-long prompts dropped, both reported."""
    lengths = list(ds[LENGTH])
    nulls = [i for i, n in enumerate(lengths) if n == NULL_PROMPT]
    too_long = [n for n in lengths if n > max_len]
    keep = [i for i, n in enumerate(lengths) if 0 <= n <= max_len]
    if nulls:
        log.warning("%s: skipped %d of %d rows whose prompt is null (rows %s)", field, len(nulls), len(lengths),
                    ", ".join(map(str, nulls[:5])) + (", ..." if len(nulls) > 5 else ""))
    if too_long and not keep:
        raise DataError(f"{field}: all {len(too_long)} prompts are longer than spec.rollout.maxPromptLength = "
                        f"{max_len} tokens (the longest has {max(too_long)}); raise maxPromptLength")
    if too_long:
        log.warning("%s: dropped %d of %d prompts longer than spec.rollout.maxPromptLength = %d tokens (the longest "
                    "has %d)", field, len(too_long), len(lengths), max_len, max(too_long))
    if not keep:
        raise DataError(f"{field}: no row has a prompt (every prompt is null)")
    return Usable(keep, len(lengths), len(nulls), len(too_long))


def _prepared(field: str, entries: Sequence[str], data: Data, renderer: PromptRenderer, cache_dir: Path,
              max_len: int) -> tuple[Any, Usable, str]:
    ds = load_table(field, entries, cache_dir)
    where = f"'{entries[0]}'" + (f" (+{len(entries) - 1})" if len(entries) > 1 else "")
    require_column(field, data.prompt_key, ds, where)
    if data.answer_key:
        require_column(f"{field} (spec.data.answerKey)", data.answer_key, ds, where)
    ds = tokenize(ds, data.prompt_key, renderer, cache_dir, field)
    return ds, _usable_rows(ds, field, max_len), _source_name(entries[0])


def _source_name(entry: str) -> str:
    """data_source for rows without that column: the file's name, or its directory's for a bare split name."""
    p = Path(entry.split("*")[0].rstrip("/") or ".").resolve()
    return p.parent.name if p.stem in ("train", "test", "eval", "validation", "dev", "") else p.stem


def load_prompt_files(data: Data, tokenizer: Any, max_prompt_length: int, cache_dir: Path,
                      batch_size: int, tools: Sequence[dict[str, Any]] = ()) -> PromptFiles:
    renderer = PromptRenderer(tokenizer, data.chat_template, data.system_prompt, tools)
    held: HeldOut | None = None
    train_ds, usable, source = _prepared("spec.data.train", data.train, data, renderer, cache_dir, max_prompt_length)
    train_rows = usable.rows
    if data.eval:
        eval_ds, eval_usable, eval_source = _prepared("spec.data.eval", data.eval, data, renderer, cache_dir,
                                                      max_prompt_length)
        eval_rows = eval_usable.rows[: data.eval_prompts]
    else:  # held out: a seeded choice of rows, and no training row that is the same row (hybridflow.data.holdout)
        if len(train_rows) <= data.eval_prompts:
            raise DataError(f"spec.data.evalPrompts = {data.eval_prompts} leaves no training prompt of the "
                            f"{len(train_rows)} usable rows in spec.data.train ({usable.short(max_prompt_length)});"
                            " lower it or give spec.data.eval")
        digests, rows = list(train_ds[DIGEST]), FileSamples(train_ds, [], data, source)

        def identity(i: int) -> tuple[str, str, str]:  # a row's own id (verl's extra_info.index) is not what it is
            s = rows.sample(train_ds[i])
            return digests[i], repr(s.truth), repr(sorted((k, v) for k, v in s.extra_info.items()
                                                          if k not in ROW_ID_KEYS))

        held = hold_out(train_rows, digests, identity, data.eval_prompts, data.seed)
        eval_ds, eval_rows, eval_source, train_rows = train_ds, held.eval_rows, source, held.train_rows
    if len(train_rows) < batch_size:
        raise DataError(f"spec.data.train: {len(train_rows)} usable training prompts cannot fill "
                        f"spec.trainer.promptsPerStep = {batch_size}"
                        + (held.shortfall() if held is not None else
                           f" ({usable.short(max_prompt_length)}); add rows or lower promptsPerStep"))
    fingerprint = hashlib.sha256(repr((train_ds._fingerprint, train_rows)).encode()).hexdigest()[:16]
    return PromptFiles(FileSamples(train_ds, train_rows, data, source), FileSamples(eval_ds, eval_rows, data,
                                                                                      eval_source), fingerprint)
