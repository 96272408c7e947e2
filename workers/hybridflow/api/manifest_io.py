"""Reading a manifest: a YAML loader bounded in size, depth and alias expansion, then validation into an RLHFJob;
every failure is a SpecError naming the file or field."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hybridflow.api.errors import SpecError, format_validation_error
from hybridflow.api.names import KIND
from hybridflow.api.schema import RLHFJob


def parse_job(doc: Any, source: str = "<manifest>") -> RLHFJob:
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: expected an RLHFJob mapping, got {type(doc).__name__}")
    try:
        return RLHFJob.model_validate(doc)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, source)) from None
    except RecursionError:  # e.g. a self-referencing structure under affinity or status
        raise SpecError(f"{source}: nested too deeply to validate; a manifest needs no more than "
                        f"{MAX_YAML_DEPTH} levels") from None


# A manifest is small and shallow; anything else is refused before it is built, let alone validated. Kubernetes
# takes requests of at most 3 MiB; the deepest real path (a pool's affinity) is about 15 levels; the aliases of a
# "billion laughs" document expand a few hundred bytes into 10^9 nodes, which pydantic and dump_job would walk.
MAX_MANIFEST_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES = 3 << 20, 64, 100_000


class ManifestLimitError(yaml.MarkedYAMLError):
    """A YAML document deeper or (aliases expanded) bigger than a manifest can be."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts: nesting past MAX_YAML_DEPTH (PyYAML's composer recurses, so an unbounded depth ends
    in RecursionError) and documents whose aliases expand past MAX_YAML_NODES are refused with the place."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels",
                                         problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expansion(node)
        return node


def _documents(text: str, name: str) -> list[Any]:
    """yaml.safe_load_all within the limits; errors point at `name`, line and column."""
    loader = _BoundedLoader(text)
    loader.name = name  # marks read it when an error is raised (else "<unicode string>")
    try:
        docs = []
        while loader.check_data():
            docs.append(loader.get_data())
        return docs
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """The node count and depth of the document with every alias expanded, each shared node measured once; a
    cycle (an anchor inside itself) is infinitely deep."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, expanded depth)

    def measure(node: yaml.Node, level: int) -> tuple[int, int]:
        if id(node) in measured:
            size, depth = measured[id(node)]
        else:
            if level > MAX_YAML_DEPTH:
                raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases are "
                                         "expanded", problem_mark=node.start_mark)
            children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                        else node.value if isinstance(node, yaml.SequenceNode) else [])
            size, depth = 1, 1
            for child in children:
                s, d = measure(child, level + 1)
                size, depth = size + s, max(depth, d + 1)
                if size > MAX_YAML_NODES:
                    raise ManifestLimitError(problem=f"more than {MAX_YAML_NODES} values once its aliases are "
                                             "expanded (a manifest has a few hundred)", problem_mark=node.start_mark)
            measured[id(node)] = size, depth
        if level + depth - 1 > MAX_YAML_DEPTH:
            raise ManifestLimitError(problem=f"nested deeper than {MAX_YAML_DEPTH} levels once its aliases are "
                                     "expanded", problem_mark=node.start_mark)
        return size, depth

    if root is not None:
        measure(root, 1)


def load_job(path: str | os.PathLike[str]) -> RLHFJob:
    """Read an RLHFJob YAML file; every failure is a SpecError naming the file or field."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{p}: no such file; pass the path of an RLHFJob YAML manifest")
    if p.stat().st_size > MAX_MANIFEST_BYTES:
        raise SpecError(f"{p}: {p.stat().st_size} bytes, more than the {MAX_MANIFEST_BYTES} a Kubernetes request may "
                        "hold; is this the manifest?")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{p}: not UTF-8 text ({err.reason} at byte {err.start}); save the manifest as UTF-8") from None
    return loads_job(text, str(p))


def loads_job(text: str, source: str = "<manifest>") -> RLHFJob:
    """An RLHFJob from manifest text (YAML or JSON), read within the same limits as a file; errors name `source`."""
    if len(text.encode()) > MAX_MANIFEST_BYTES:
        raise SpecError(f"{source}: more than the {MAX_MANIFEST_BYTES} bytes a Kubernetes request may hold")
    try:
        docs = [d for d in _documents(text, source) if d is not None]
    except ManifestLimitError as err:
        raise SpecError(f"{source}: refused: {err}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to read; a manifest needs no more than {MAX_YAML_DEPTH} "
                        "levels") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise SpecError(f"{source}: expected exactly one document of kind {KIND}, found {len(jobs)}")
    return parse_job(jobs[0], source)


def dump_job(job: RLHFJob) -> dict[str, Any]:
    return job.model_dump(by_alias=True, exclude_none=True, mode="json")
