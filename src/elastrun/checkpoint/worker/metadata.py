"""DCP's checkpoint metadata as JSON, and back; the ranks' metadata as one.

DCP's own file systems pickle their ``Metadata``; a memory checkpoint stores it as
versioned JSON (the house rule for state that outlives a process): the tensors' and
values' entries, the planner's data (the default planner's map of flattened names to
their paths in the state dict), and where each item lies in the rank's data file
(:class:`Span`). A planner whose data is not made of JSON's values, tuples and
string-keyed dicts cannot be stored, and says so.

Each rank's checkpoint holds its own metadata (its chunks of each tensor).
:func:`merge_metadata` makes the union of several ranks' -- DCP's global metadata, which
a collective save's coordinator would have written -- so that DCP plans a load into
another world size (its resharding: each rank reads the parts of the stored chunks that
overlap its own) and the reader knows which rank's file holds each chunk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from elastrun.checkpoint.worker.errors import MemoryCheckpointError
from elastrun.wire.checkpoint import VERSION

__all__ = ["Span", "decode_metadata", "encode_metadata", "merge_metadata"]


@dataclass(frozen=True)
class Span:
    """Where one item lies in a rank's data file: ``offset`` and ``length`` in bytes;
    for a tensor, the dtype and shape of the stored chunk (None for a value)."""

    offset: int
    length: int
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None


def encode_metadata(metadata: Metadata) -> str:
    """The JSON text of ``metadata`` (whose ``storage_data`` maps indexes to spans).

    Raises:
        MemoryCheckpointError: the planner's data holds something JSON cannot carry.
    """
    items: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            items[fqn] = {"kind": "bytes"}
        else:
            items[fqn] = {
                "kind": "tensor",
                "properties": _properties(entry.properties),
                "size": list(entry.size),
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks
                ],
            }
    storage = [_span_entry(index, span) for index, span in (metadata.storage_data or {}).items()]
    meta = metadata.storage_meta
    doc = {
        "version": VERSION,
        "dcp_version": metadata.version,
        "items": items,
        "planner_data": _plain(metadata.planner_data, "planner_data"),
        "storage": storage,
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
    }
    return json.dumps(doc, separators=(",", ":"))


def decode_metadata(text: str | bytes) -> Metadata:
    """The ``Metadata`` that :func:`encode_metadata` wrote.

    Raises:
        MemoryCheckpointError: not such a document, or of another version.
    """
    try:
        doc = json.loads(text)
        version = doc.get("version")
        if version != VERSION:
            raise MemoryCheckpointError(
                f"checkpoint metadata of version {version!r}; this elastrun reads {VERSION}"
            )
        items = {fqn: _storage_entry(e) for fqn, e in doc["items"].items()}
        storage = {
            MetadataIndex(e["fqn"], e["offset"], e["index"]): _span(e) for e in doc["storage"]
        }
        meta = doc.get("storage_meta")
        return Metadata(
            state_dict_metadata=items,
            planner_data=_unplain(doc.get("planner_data")),
            storage_data=storage,
            storage_meta=None if meta is None else StorageMeta(**meta),
            version=doc.get("dcp_version"),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MemoryCheckpointError(f"unreadable checkpoint metadata: {exc!r}") from exc


def merge_metadata(metas: Mapping[int, Metadata]) -> tuple[Metadata, dict[MetadataIndex, int]]:
    """The union of ranks' metadata (``metas``: rank -> its metadata): every tensor's
    chunks (a chunk that several ranks hold, a replicated tensor's, once), every value,
    the planners' data; and the rank whose data file holds each stored item (the lowest
    that holds it).

    Raises:
        MemoryCheckpointError: no metadata, or ranks that disagree on an item's kind,
            size or dtype.
    """
    if not metas:
        raise MemoryCheckpointError("no rank's metadata to load from")
    items: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    chunks: dict[str, dict[tuple[int, ...], ChunkStorageMetadata]] = {}
    storage: dict[MetadataIndex, Span] = {}
    where: dict[MetadataIndex, int] = {}
    planner: dict[str, Any] = {}
    for rank in sorted(metas):
        meta = metas[rank]
        for fqn, entry in meta.state_dict_metadata.items():
            _merge_entry(items, chunks, fqn, entry)
        for index, span in (meta.storage_data or {}).items():
            if index not in storage:
                storage[index] = span
                where[index] = rank
        if isinstance(meta.planner_data, dict):
            planner.update(meta.planner_data)
    for fqn, entry in items.items():
        if isinstance(entry, TensorStorageMetadata):
            entry.chunks = list(chunks[fqn].values())
    first = metas[min(metas)]
    merged = Metadata(
        state_dict_metadata=dict(items),
        planner_data=planner or first.planner_data,
        storage_data=storage,
        storage_meta=first.storage_meta,
        version=first.version,
    )
    return merged, where


def _merge_entry(
    items: dict[str, TensorStorageMetadata | BytesStorageMetadata],
    chunks: dict[str, dict[tuple[int, ...], ChunkStorageMetadata]],
    fqn: str,
    entry: TensorStorageMetadata | BytesStorageMetadata,
) -> None:
    seen = items.get(fqn)
    if isinstance(entry, BytesStorageMetadata):
        if seen is None:
            items[fqn] = entry
        elif not isinstance(seen, BytesStorageMetadata):
            raise MemoryCheckpointError(f"{fqn}: a tensor on one rank, a value on another")
        return
    if seen is None:
        items[fqn] = TensorStorageMetadata(properties=entry.properties, size=entry.size, chunks=[])
        chunks[fqn] = {}
    elif not isinstance(seen, TensorStorageMetadata):
        raise MemoryCheckpointError(f"{fqn}: a value on one rank, a tensor on another")
    elif seen.size != entry.size or seen.properties.dtype != entry.properties.dtype:
        raise MemoryCheckpointError(
            f"{fqn}: ranks disagree on it ({tuple(seen.size)} {seen.properties.dtype} and "
            f"{tuple(entry.size)} {entry.properties.dtype})"
        )
    for chunk in entry.chunks:
        chunks[fqn].setdefault(tuple(chunk.offsets), chunk)


# -- tensors ---------------------------------------------------------------------------


def _torch_name(value: object) -> str:
    return str(value).removeprefix("torch.")


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise ValueError(f"torch has no {kind.__name__} {name!r}")
    return value


def _properties(p: TensorProperties) -> dict[str, Any]:
    return {
        "dtype": _torch_name(p.dtype),
        "layout": _torch_name(p.layout),
        "requires_grad": p.requires_grad,
        "memory_format": _torch_name(p.memory_format),
        "pin_memory": p.pin_memory,
    }


def _storage_entry(entry: dict[str, Any]) -> TensorStorageMetadata | BytesStorageMetadata:
    if entry["kind"] == "bytes":
        return BytesStorageMetadata()
    p = entry["properties"]
    properties = TensorProperties(
        dtype=_torch_attr(p["dtype"], torch.dtype),
        layout=_torch_attr(p["layout"], torch.layout),
        requires_grad=bool(p["requires_grad"]),
        memory_format=_torch_attr(p["memory_format"], torch.memory_format),
        pin_memory=bool(p["pin_memory"]),
    )
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
        for c in entry["chunks"]
    ]
    return TensorStorageMetadata(
        properties=properties, size=torch.Size(entry["size"]), chunks=chunks
    )


def _span_entry(index: MetadataIndex, span: Span) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "at": span.offset,
        "bytes": span.length,
        "dtype": None if span.dtype is None else _torch_name(span.dtype),
        "shape": None if span.shape is None else list(span.shape),
    }


def _span(entry: dict[str, Any]) -> Span:
    return Span(
        offset=int(entry["at"]),
        length=int(entry["bytes"]),
        dtype=None if entry["dtype"] is None else _torch_attr(entry["dtype"], torch.dtype),
        shape=None if entry["shape"] is None else tuple(int(n) for n in entry["shape"]),
    )


# -- the planner's data ----------------------------------------------------------------
# JSON's scalars and lists as they are; a tuple as {"t": [...]} and a dict as {"d": {...}},
# so that the only objects in the encoding are these tags and both come back as they were.


def _plain(value: object, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return {"t": [_plain(v, where) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"d": {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}}
    raise MemoryCheckpointError(
        f"a memory checkpoint stores DCP's metadata as JSON, and the planner's data holds "
        f"a {type(value).__name__} at {where}: use DCP's default planner"
    )


def _unplain(value: Any) -> Any:
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if "t" in value:
            return tuple(_unplain(v) for v in value["t"])
        return {k: _unplain(v) for k, v in value["d"].items()}
    return value
