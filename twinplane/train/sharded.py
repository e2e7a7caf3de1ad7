"""Sharded checkpoint state: every rank writes and reads only its own shards of a model and its AdamW state, with
torch.distributed.checkpoint (DCP), so no process ever holds the full state, and a checkpoint loads onto any number of
ranks (DCP reads each rank's slice by the global offsets it records for every shard).

One folder per model (`policy/`, `critic/`): DCP's `.metadata` and `__R_0.distcp` files (one per rank, tensors only:
parameters under `model.`, AdamW state under `optim.`) and `optimizer.json`, the param groups without their
parameters (hyperparameters only: numbers and flags). Parameters are the trainable ones (with LoRA the adapters: the
frozen base is referred to, not copied). DCP pickles its `.metadata`; it is read here with an unpickler that builds
DCP's own metadata classes and nothing else, and tensors are read with `torch.load(weights_only=True)`.

Saving is synchronous: a checkpoint is sealed (fsynced, manifest written) right after, so an asynchronous save would
only move the same write a few milliseconds later, and its staging copy would cost the host memory this format saves.
"""

from __future__ import annotations

import json
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

METADATA = ".metadata"
PARAM_GROUPS = "optimizer.json"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused: {module}.{name} is not part of a DCP metadata file")


class SafeReader(FileSystemReader):
    """DCP's file reader with a metadata unpickler limited to DCP's metadata classes."""

    def read_metadata(self, *args, **kwargs):
        with Path(self._get_metadata_path(kwargs.get("rank"))).open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def is_sharded(folder: Path) -> bool:
    return (Path(folder) / METADATA).is_file()


_OPTIONS = StateDictOptions(ignore_frozen_params=True)  # LoRA: the base is frozen, not part of the run's state


def _dist_options(group) -> dict:
    return {"process_group": group, "no_dist": group is None and not dist.is_initialized()}


def save(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, group=None) -> None:
    """Write this rank's shards of `model` and `opt` to `folder` (a collective over `group`: every rank calls;
    None: one process). No tensor is gathered: each rank writes the local shards of its DTensors."""
    msd, osd = get_state_dict(model, opt, options=_OPTIONS)
    with warnings.catch_warnings(), _plain_errors(folder):  # one process: DCP warns it saves without torch.distributed
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd["state"]}, storage_writer=FileSystemWriter(folder), **_dist_options(group))
    if group is None or dist.get_rank(group) == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
        (Path(folder) / PARAM_GROUPS).write_text(json.dumps(groups))


def load(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, group=None) -> None:
    """Fill `model` and `opt` (sharded over `group`'s ranks, any number of them) from `folder`: each rank reads the
    slices of the saved shards that make up its own."""
    SafeReader(folder).read_metadata()  # a damaged or foreign .metadata fails here, in one line, before DCP logs it
    msd, osd = get_state_dict(model, opt, options=_OPTIONS)  # the targets: this rank's shards (AdamW's initialised)
    state = {"model": msd, "optim": osd["state"]}
    _load(state, folder, group)
    saved = json.loads((Path(folder) / PARAM_GROUPS).read_text())
    if len(saved) != len(osd["param_groups"]):
        raise ValueError(f"{folder}: {len(saved)} optimizer param groups, the model has {len(osd['param_groups'])}")
    groups = [g | {k: tuple(v) if isinstance(v, list) else v for k, v in s.items()}
              for g, s in zip(osd["param_groups"], saved, strict=True)]
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": groups},
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def load_model_only(folder: Path, model: torch.nn.Module) -> None:
    """The saved parameters into a plain (unsharded) `model` in this process, reading only the `model.` entries:
    the optimizer's state is never read (export). Each parameter takes the dtype it was saved in: a model built
    from its config alone can differ from the trained one there (transformers keeps some modules in fp32 only when
    it loads weights), and DCP would cast silently."""
    saved = SafeReader(folder).read_metadata().state_dict_metadata
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for n, p in params.items():
        dtype = getattr(getattr(saved.get(f"model.{n}"), "properties", None), "dtype", p.dtype)
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    _load({"model": {n: p.detach() for n, p in params.items()}}, folder, None)


def _load(state: dict, folder: Path, group) -> None:
    with warnings.catch_warnings(), _plain_errors(folder):
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeReader(folder), **_dist_options(group))


@contextmanager
def _plain_errors(folder: Path):
    """DCP's CheckpointException (a BaseException, past every `except Exception`) as a ValueError naming the first
    rank's cause, e.g. a saved tensor's shape that is not the model's."""
    try:
        yield
    except CheckpointException as e:
        causes = [f[0] for f in e.failures.values() if isinstance(f, tuple) and f] if isinstance(
            getattr(e, "failures", None), dict) else []
        cause = causes[0] if causes else e
        raise ValueError(f"{folder}: {type(cause).__name__}: {(str(cause).splitlines() or [''])[-1]}") from None

