"""The building blocks of the schema: bounded strings that carry Kubernetes' grammars into both pydantic and the
CRD's `pattern`, size limits, and the base model every section shares."""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from hybridflow.algorithms.registry import Registry
from hybridflow.api.names import DNS1123_SUBDOMAIN, LABEL_VALUE, POOL_NAME, QUANTITY

MAX_NODES, MAX_DEVICES_PER_NODE, MAX_POOLS, MAX_BACKOFF = 1024, 64, 16, 1000
MAX_COUNT = 1 << 20  # prompts, batch sizes, token lengths
MAX_STEPS = 10_000_000
MAX_PATH, MAX_TEXT = 4096, 65536  # a file path; a prompt or template (the resolved spec lives in a 1 MiB ConfigMap)
MAX_SEED = 2**32 - 1  # numpy's seeds, which vLLM sets


def matching(pattern: str, what: str) -> AfterValidator:
    """A check with a message saying what is expected (pydantic's own names only the regex); fullmatch, since
    Python's `$` also matches before a trailing newline and Go's does not."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"must be {what}, got {value!r}")
        return value

    return AfterValidator(check)


def registered(registry: Registry[Any], value: str) -> str:
    """A name checked against its registry when the manifest is validated (not when the schema is built), so an
    entry registered later, by a plug-in or a test, is accepted too."""
    try:
        registry[value]
    except KeyError as err:  # the registry's own message: the name and the registered ones
        raise ValueError(err.args[0]) from None
    return value


def _matched_string(pattern: str, max_length: int, what: str) -> Any:
    return Annotated[str, Field(min_length=1, max_length=max_length, json_schema_extra={"pattern": pattern}),
                     matching(pattern, what)]


ObjectName = _matched_string(DNS1123_SUBDOMAIN, 253, "a Kubernetes object name (a DNS-1123 subdomain: lowercase "
                             "letters, digits, '-' and '.', a letter or digit at both ends, e.g. 'my-data')")
Quantity = _matched_string(QUANTITY, 64, "a Kubernetes quantity such as 4Gi, 512Mi, 2 or 500m")
PoolName = _matched_string(POOL_NAME, 63, "lowercase letters and digits only, e.g. 'gpus' (no '-': the pods "
                       "'<job>-<pool>-<index>-g<gen>' of two jobs could otherwise get the same name)")
# A model's module name as PEFT matches it (a suffix of the module's dotted path: `q_proj`, `self_attn.q_proj`)
ModuleName = _matched_string(r"^[A-Za-z0-9_.]+$", 128, "a module name such as q_proj (letters, digits, '_' and '.')")
LabelValue = Annotated[str, Field(max_length=63, json_schema_extra={"pattern": LABEL_VALUE}),
                       matching(LABEL_VALUE, "a label value: at most 63 letters, digits, '-', '_' and '.', a letter "
                                 "or digit at both ends")]
# A placement key is a role name (the longest has 11 characters). Bounded, and checked before anything quotes it: a
# 200 KB key repeated into every message about it (and the job's status) is refused with its length only.
MAX_ROLE_KEY = 63


def short_keys(limit: int, what: str) -> BeforeValidator:
    """Refuse a mapping with a key longer than `limit`, naming its length and its start, not the whole key."""
    def check(value: Any) -> Any:
        for key in value if isinstance(value, dict) else ():
            if isinstance(key, str) and len(key) > limit:
                raise ValueError(f"{what} are at most {limit} characters; got one of {len(key)} starting {key[:20]!r}")
        return value

    return BeforeValidator(check)


FilePath = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
FileList = Annotated[list[FilePath], Field(max_length=1024)]


def _one_or_more(value: Any) -> Any:
    """verl's data.train_files takes one path or a list of them, and a job copied from verl says `train: x.parquet`:
    a single path is a one-element list."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"give a path or a list of paths, e.g. data/train.parquet or [a.parquet, b.parquet], "
                         f"got {value!r}")
    return value


# The JSON Schema (and so the CRD) says both forms; the CRD states it as crd.py's untyped union.
PathOrPaths = Annotated[FileList, BeforeValidator(_one_or_more, json_schema_input_type=FilePath | FileList)]
PythonName = _matched_string(r"^[A-Za-z_][A-Za-z0-9_]*$", 253, "a Python function name, e.g. compute_score")


class SpecModel(BaseModel):
    # No .inf/.nan: YAML has them, JSON (and so the API server) does not.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True, allow_inf_nan=False
    )

