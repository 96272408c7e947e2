"""A role's engine state as a torch.distributed.checkpoint (DCP) directory: every rank writes its own shards in
parallel (`__<rank>_0.distcp`, rank 0 also the `.metadata` index), and a load re-shards them to whatever layout the
loading engines have (another world size, another tensor-parallel size), because engines name their state by the
whole tensor (HF parameter names) rather than by shard.

Checkpoints live on storage other jobs and people can write, so reading one never unpickles arbitrary objects: DCP's
reader unpickles its `.metadata` index and its planner loads non-tensor values with `torch.load(weights_only=False)`;
both are replaced here by loaders that accept only DCP's own metadata classes and plain data.

Each rank also hashes the files it wrote (in parallel, like the writes), so the controller can seal the checkpoint's
manifest without reading every byte again."""
from __future__ import annotations

import collections
import contextlib
import enum
import concurrent.futures
import io
import logging
import os
import pathlib
import pickle
import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # object storage
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from hybridflow.checkpoint.store import (
    CheckpointError, StoragePath, is_link, is_remote, link_refused, open_tail, relative, sha256, storage_path,
)

log = logging.getLogger("hybridflow.checkpoint")

METADATA = ".metadata"


class CheckpointFormatError(CheckpointError):
    """A DCP directory that holds something other than DCP metadata and plain data."""


# --- reading without unpickling arbitrary objects ---

_DCP_CLASSES = {(c.__module__, c.__qualname__): c for c in (
    dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo)}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
# plain constructors the index pickles (paths of the checkpoint id, torch's layout-by-name lookup)
_PLAIN = {("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
          ("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          ("collections", "OrderedDict"): collections.OrderedDict}


_BUILDABLE = tuple(c for c in _DCP_CLASSES.values() if not issubclass(c, enum.Enum))
_SHARD_FILE = re.compile(r"^__\d+_\d+\.distcp$")


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its opcodes can be checked one by one
    """Unpickles DCP's `.metadata` index: its own dataclasses, torch dtypes, layouts and Size, paths, containers.
    Building (setting attributes) is allowed only on fresh instances of DCP's dataclasses, never on a class, a
    function or a shared object (which would change them for the whole process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_CLASSES.get((module, name)) or _PLAIN.get((module, name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            found = getattr(torch, name)
        if found is None:
            raise CheckpointFormatError(f"{module}.{name}")
        return found

    def load_build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type) or not isinstance(target, _BUILDABLE):
            raise CheckpointFormatError(f"attributes set on {type(target).__name__} {str(target)[:80]!r}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _check_storage(metadata: dcp_metadata.Metadata, where: str) -> None:
    """Every shard the index points at is one of this directory's own `__<rank>_<n>.distcp` files: a crafted index
    must not pull another file (another job's shards on the same volume) into this job's weights."""
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not _SHARD_FILE.match(path):
            raise CheckpointFormatError(f"refusing to load {where}: its {METADATA} points at {path!r}, not at a shard "
                                        f"file of its own directory")


# Bounds on what an index may make a reader allocate. The index of a 70B model with its optimizer state on 512
# ranks is a few MB with some 10^5-10^6 entries; tensors and shard slices must fit in the shard files on disk.
MAX_METADATA_BYTES = 256 << 20
MAX_INDEX_ENTRIES = 1 << 22
MAX_TENSOR_DIMS = 16


def _check_sizes(metadata: dcp_metadata.Metadata, shard_bytes: dict[str, int], where: str) -> None:
    """What the index claims must fit the data this directory holds, before anything is allocated from it: a
    crafted index could otherwise have the reader (export's empty-state planner above all) allocate a tensor of
    2^60 elements, or loop over billions of chunks."""
    def refuse(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"refusing to load {where}: its {METADATA} {why}; delete this checkpoint")

    entries, storage = metadata.state_dict_metadata or {}, metadata.storage_data or {}
    if len(entries) > MAX_INDEX_ENTRIES or len(storage) > MAX_INDEX_ENTRIES:
        raise refuse(f"has {len(entries)} entries and {len(storage)} shard slices (at most {MAX_INDEX_ENTRIES})")
    total = sum(shard_bytes.values())
    for info in storage.values():
        size = shard_bytes.get(info.relative_path)
        if size is None or not (0 <= info.offset and 0 <= info.length and info.offset + info.length <= size):
            raise refuse(f"points at bytes {info.offset}..{info.offset + info.length} of {info.relative_path}, "
                         f"which has {size if size is not None else 'no'} bytes")
    for fqn, meta in entries.items():
        if not isinstance(meta, dcp_metadata.TensorStorageMetadata):
            continue
        dims = list(meta.size)
        if len(dims) > MAX_TENSOR_DIMS or any(not isinstance(d, int) or d < 0 for d in dims):
            raise refuse(f"gives {fqn!r} the shape {dims}")
        numel = 1
        for d in dims:
            numel *= d
        nbytes = numel * torch.tensor([], dtype=meta.properties.dtype).element_size()
        if nbytes > total:
            raise refuse(f"gives {fqn!r} {nbytes} bytes, more than its shard files hold ({total})")
        if len(meta.chunks) > MAX_INDEX_ENTRIES:
            raise refuse(f"cuts {fqn!r} into {len(meta.chunks)} chunks")
        for chunk in meta.chunks:
            if len(chunk.offsets) != len(dims) or len(chunk.sizes) != len(dims) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, dims)):
                raise refuse(f"has a chunk of {fqn!r} at {list(chunk.offsets)} + {list(chunk.sizes)} outside its "
                             f"shape {dims}")


def _shard_file_sizes(directory: Any) -> dict[str, int]:
    """The size of each `__<rank>_<n>.distcp` file of a DCP directory."""
    where, out = storage_path(str(directory)), {}
    for p in where.iterdir():
        if _SHARD_FILE.match(p.name):
            if is_link(p):  # never followed (store.open_below)
                raise link_refused(p)
            out[p.name] = p.stat().st_size
    return out


class _SafeMetadata:
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as f:  # type: ignore[attr-defined]
            data = f.read(MAX_METADATA_BYTES + 1)  # the unpickler then reads from memory: no length it meets can
        if len(data) > MAX_METADATA_BYTES:  # make it allocate more than the file holds
            raise CheckpointFormatError(f"refusing to load {self.path}: its {METADATA} is over "
                                        f"{MAX_METADATA_BYTES >> 20} MB; delete this checkpoint")
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointFormatError as err:
            raise CheckpointFormatError(
                f"refusing to load {self.path}: its {METADATA} names {err}, which could run code when loaded. "
                f"Checkpoints are only loaded as data; delete this checkpoint or point spec.trainer.checkpointDir "
                f"elsewhere") from err
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, MemoryError) as err:
            raise CheckpointFormatError(f"refusing to load {self.path}: its {METADATA} is not a readable index "
                                        f"({type(err).__name__}: {str(err)[:200]})") from err
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointFormatError(f"{path} is not a DCP metadata index")
        _check_storage(metadata, str(self.path))
        _check_sizes(metadata, _shard_file_sizes(self.path), str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _NoFollowFileSystem(FileSystem):
    """DCP's local file system, reading each file without following a symbolic link in its last three components
    (`<step_N>/<role>/<file>`, store.open_tail): a link planted in a checkpoint on a shared claim, at its step
    directory, its role's directory or a shard, is refused (store.LinkRefused, naming it) rather than read."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_tail(Path(path), 3) as stream:
            yield stream


class SafeReader(_SafeMetadata, FileSystemReader):
    """DCP's reader of a local directory, with the data-only metadata index, never reading through a link."""

    def __init__(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _NoFollowFileSystem()


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's reader of object storage (fsspec), with the data-only metadata index."""


class _DataOnlyValues:
    """A load planner's non-tensor values (step counts, param groups) with `torch.load(weights_only=True)`: data,
    never objects that run code (DCP's own planners unpickle them in full)."""

    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_DataOnlyValues, DefaultLoadPlanner):
    """DCP's planner for loading into a template (the engine's own state)."""


class _SafeEmptyPlanner(_DataOnlyValues, _EmptyStateDictLoadPlanner):
    """DCP's planner for reading a whole checkpoint into an empty state (export)."""


# --- writing ---

def _writer(directory: StoragePath) -> FileSystemWriter:
    # one file per rank (the layout resharding reads back); fsync'd, as the seal that follows expects
    if is_remote(directory):
        return FsspecWriter(str(directory), single_file_per_rank=True, sync_files=False, thread_count=1)
    return FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)


def _reader(directory: StoragePath) -> FileSystemReader:
    return SafeFsspecReader(str(directory)) if is_remote(directory) else SafeReader(str(directory))


def own_files(directory: StoragePath, rank: int) -> list[StoragePath]:
    """The files rank `rank` wrote into a DCP directory (rank 0 also writes the metadata index)."""
    mine = sorted(p for p in directory.iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp"))
    return mine + ([directory / METADATA] if rank == 0 else [])


def digests(directory: Path, rank: int, relative_to: Path) -> dict[str, str]:
    """SHA-256 of this rank's files, named relative to the checkpoint (what its manifest lists)."""
    return {relative(p, relative_to): sha256(p) for p in own_files(directory, rank)}


def _all_ready(problem: BaseException | None, directory: StoragePath, group: dist.ProcessGroup) -> None:
    """Collective: every rank enters DCP's collectives, or none does. A rank that cannot start writing (its
    directory could not be made, its host copy failed) tells the others, which then fail at once with its error
    (an OSError keeps its errno: a full disk on any rank reads as one), instead of waiting in DCP's first gather for
    it until the group's timeout (30 minutes)."""
    mine = None if problem is None else (getattr(problem, "errno", None), f"{type(problem).__name__}: {problem}")
    reports: list[tuple[int | None, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)
    if problem is not None:
        raise problem
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        rank, (code, text) = failed[0]
        message = f"rank {rank} could not start writing {directory}: {text}"
        raise OSError(code, message) if code else CheckpointError(message)


def _ready(directory: StoragePath, prepare: Callable[[], None] | None) -> BaseException | None:
    """What keeps this rank from writing into `directory` (None: nothing); `prepare` is this rank's own part of the
    checkpoint besides its shards (rank 0: the model's config and tokenizer files)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if prepare is not None:
            prepare()
    except Exception as err:  # noqa: BLE001 - whatever it is, the other ranks hear of it (then it is raised)
        return err
    return None


def save(state: dict[str, Any], directory: Path, checkpoint: Path,
         prepare: Callable[[], None] | None = None) -> dict[str, str]:
    """Collective: every rank writes its shards of `state` into `directory` (inside the checkpoint directory
    `checkpoint`), after its `prepare`; returns this rank's `digests` once its files are on disk."""
    _background.submit(lambda: None).result()  # no asynchronous write still uses the checkpoint group
    _all_ready(_ready(directory, prepare), directory, checkpoint_group())
    dcp.save(state, storage_writer=_writer(directory))
    return digests(directory, dist.get_rank() if dist.is_initialized() else 0, checkpoint)


# One writer thread per process: asynchronous saves of several roles in one process run one after another, in the
# order they were started, which is the same on every rank (their collectives must pair up).
_background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridflow-checkpoint")


def _yield_to_training() -> None:
    """Lower this (the writer) thread's CPU priority: serialising, hashing and writing then use the cores training
    leaves idle instead of slowing its steps (Linux gives each thread its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def save_async(state: dict[str, Any], directory: Path, checkpoint: Path,
               prepare: Callable[[], None] | None = None) -> concurrent.futures.Future:
    """Collective: copies this rank's `state` to host memory now, so that the engine may train on while the copy is
    written, and writes and hashes it (after `prepare`) in the background. The future gives this rank's
    `digests`, or raises what failed on any rank."""
    group = checkpoint_group()
    rank = dist.get_rank()
    writer: FileSystemWriter | None = None
    try:
        writer = _writer(directory)
        staged, problem = writer.stage(state), None  # a host copy: later optimizer steps do not reach what is written
    except Exception as err:  # noqa: BLE001 - this rank still joins the others' agreement, which then fails
        staged, problem = None, err

    def write() -> dict[str, str]:
        _yield_to_training()
        _all_ready(problem or _ready(directory, prepare), directory, group)
        dcp.save(staged, storage_writer=writer, process_group=group)
        return digests(directory, rank, checkpoint)

    return _background.submit(write)


# --- reading ---

def load(state: dict[str, Any], directory: Path, process_group: dist.ProcessGroup | None = None) -> None:
    """Collective: fill `state` (the loading engine's own `checkpoint_state()`, in its layout) in place."""
    _reader(directory).read_metadata()  # a hostile index fails here, with its own message, not deep in DCP
    with _refusals(directory):
        dcp.load(state, storage_reader=_reader(directory), planner=SafeLoadPlanner(),
                 process_group=process_group)


@contextlib.contextmanager
def _refusals(directory: Path) -> Iterator[None]:
    """A value the data-only loader refused, raised as what it is rather than as DCP's per-rank report."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        for failure in err.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, pickle.UnpicklingError):
                lines = str(cause).splitlines() or [""]
                what = next((line.strip() for line in lines if "GLOBAL" in line), lines[0])
                raise CheckpointFormatError(
                    f"refusing to load {directory}: it holds a value other than tensors and plain data, which could "
                    f"run code when loaded ({what}). "
                    f"Checkpoints are only loaded as data; delete this checkpoint or point spec.trainer.checkpointDir "
                    f"elsewhere") from err
        raise


def read_full(directory: Path, keys: set[str] | None = None) -> dict[str, Any]:
    """The state of a DCP directory in this process, every tensor whole (no process group needed): what
    `hybridflow export` and tests read. `keys`: only these top-level entries (e.g. {"model"}, not the optimizer)."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _reader(directory).read_metadata()
    state: dict[str, Any] = {}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        with _refusals(directory):
            _load_state_dict(state, storage_reader=_reader(directory), planner=_SafeEmptyPlanner(keys=keys),
                             no_dist=True)
    return state


def is_dcp_dir(directory: StoragePath) -> bool:
    return (directory / METADATA).is_file()


_checkpoint_groups: dict[int, dist.ProcessGroup] = {}


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group over the whole world for checkpoint writes (collective the first time it is asked for): an
    asynchronous write's collectives run in the background thread while training uses the default group, and gloo
    takes the CPU tensors of the agreement before a write whatever backend trains (NCCL on GPUs)."""
    key = id(dist.group.WORLD)
    if key not in _checkpoint_groups:
        _checkpoint_groups[key] = dist.new_group(backend="gloo")
    return _checkpoint_groups[key]
