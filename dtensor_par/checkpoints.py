"""Checkpoint folders in the transformers and diffusers layout (config.json + safetensors), read
and written piece by piece.

``empty_model`` builds the model from its config with every parameter on ``meta`` (buffers
computed for real, so rotary frequencies and position ids come out as the constructor computes
them); parallelized (``api.from_pretrained``), it holds only this rank's pieces, and
``load_checkpoint`` reads each piece's bytes from the files: no rank ever holds a whole copy.
Files are read with ``pread``, not memory-mapped: mapped pages count toward a process's RSS, and
a column slice touches every page of a tensor.
``save_pretrained`` writes the same layout from a parallelized model, every rank writing files of
its own: each tensor is gathered to the one rank that writes it, one at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .checkpoint_keys import CONVERTED_SHOWN, Composite, Stretch, leaves, model_sources
from .pieces import held_indices, held_runs, piece_blocks, runs
from .sharded import sharded_state

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
          "U8": torch.uint8, "BOOL": torch.bool}
"""safetensors' dtype names."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

WEIGHTS = ("model.safetensors", "diffusion_pytorch_model.safetensors")
"""The weights file of a transformers folder, of a diffusers component folder; sharded, each
with ``.index.json`` beside its numbered shards."""

READ_BYTES = 16 << 20
"""The most one read of a tensor that must be selected from (a piece that is not whole rows, or
of another dtype or device) holds at once: the bound on what loading adds to a rank's memory
beyond its pieces."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its bytes start at ``offset`` of ``file``."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def read_header(file: str) -> dict[str, Entry]:
    """The tensors of one safetensors file, by key: an 8-byte little-endian header length, the
    JSON header ``{key: {dtype, shape, data_offsets}}``, then the data. Each tensor's bytes are
    checked to lie in the file, so a truncated file fails here, before anything is read."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{file} is not a safetensors file: {size} bytes")
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            raise ValueError(f"{file} is not a safetensors file: a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    entries = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has safetensors dtype {entry['dtype']!r}, which torch does not "
                             f"read (known: {', '.join(DTYPES)})")
        dtype, shape, (begin, end) = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or 8 + length + end > size:
            raise ValueError(f"{file}: tensor {key!r} ({entry['dtype']}, shape {shape}: {nbytes} bytes) has bytes "
                             f"[{begin}, {end}) after the header, in a file of {size - 8 - length} data bytes")
        entries[key] = Entry(file, dtype, shape, 8 + length + begin)
    return entries


def checkpoint_entries(path: str) -> dict[str, Entry]:
    """Every tensor of the checkpoint folder ``path``, by key, from the headers alone."""
    for weights in WEIGHTS:
        single, index = os.path.join(path, weights), os.path.join(path, weights + ".index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
            if missing:
                raise FileNotFoundError(f"{index} names shard files that are not in {path}: {missing}")
            entries = {}
            for name in files:
                entries.update(read_header(os.path.join(path, name)))
            absent = sorted(key for key, name in weight_map.items()
                            if key not in entries or entries[key].file != os.path.join(path, name))
            if absent:
                raise ValueError(f"{index} places tensors in shard files whose headers lack them: {absent}")
            return entries
        if os.path.isfile(single):
            return read_header(single)
    looked = [name for weights in WEIGHTS for name in (weights, weights + ".index.json")]
    raise FileNotFoundError(f"{path!r} is not a checkpoint folder: it has none of {looked}")


@contextlib.contextmanager
def parameters_on_meta():
    """While a model is built: each parameter put on ``meta`` as it is registered, buffers built
    for real (accelerate's ``init_empty_weights``), so that values only the constructor computes
    (rotary frequencies) are there. A parameter is made, then moved before any initializer writes
    it: its memory is never touched. Tied parameters stay one object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(model_cls: type, path: str, torch_dtype: torch.dtype | None = None) -> nn.Module:
    """``model_cls`` built from the config of the checkpoint folder ``path``, parameters on
    ``meta``, in eval mode (as the libraries' ``from_pretrained``): transformers'
    ``_from_config``, diffusers' ``from_config``; under ``torch_dtype``, its state (not other
    buffers) in that dtype or, as the library keeps them, float32. A folder with no weights or no
    config is refused before anything is built, not where its pieces are read."""
    checkpoint_entries(path)
    diffusers = hasattr(model_cls, "load_config")  # ConfigMixin; transformers' PreTrainedModel has _from_config
    if not (diffusers or hasattr(model_cls, "_from_config")):
        raise TypeError(f"from_pretrained builds transformers and diffusers models from their config, not "
                        f"{model_cls.__name__}: build it on meta, parallelize it and call load_checkpoint")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} is not a checkpoint folder: it has no config.json")
    with parameters_on_meta():
        if diffusers:
            model = model_cls.from_config(model_cls.load_config(path))
        else:
            config = model_cls.config_class.from_pretrained(path)
            model = model_cls._from_config(config, **({"dtype": torch_dtype} if torch_dtype is not None else {}))
    if torch_dtype is not None:
        kept = _kept_in_float32(model, torch_dtype)
        for key, tensor in model.state_dict(keep_vars=True).items():
            if key in kept:
                tensor.data = tensor.data.to(torch.float32)
            elif diffusers and tensor.is_floating_point():  # transformers built them in torch_dtype
                tensor.data = tensor.data.to(torch_dtype)
    return model.eval()


def _kept_in_float32(model: nn.Module, torch_dtype: torch.dtype) -> set[str]:
    """The keys of the parameters and persistent buffers the library's own ``from_pretrained``
    keeps in float32 under ``torch_dtype`` (its ``_keep_in_fp32_modules``: modules whose precision
    the model needs): transformers' dtype plan (key patterns, searched), diffusers' module names (a
    key's parts)."""
    if hasattr(model, "_get_dtype_plan"):
        patterns = [re.compile(p.replace("*", ".*")) for p, dtype in model._get_dtype_plan(torch_dtype).items()
                    if dtype == torch.float32]
        kept = lambda key: any(p.search(key) for p in patterns)  # noqa: E731
    else:
        modules = getattr(model, "_keep_in_fp32_modules", None) or []
        modules = [modules] if isinstance(modules, str) else modules
        kept = lambda key: any(m in key.split(".") for m in modules)  # noqa: E731
    return {key for key, t in model.state_dict(keep_vars=True).items() if t.is_floating_point() and kept(key)}


def load_checkpoint(model: nn.Module, path: str, *, stages: list[nn.Module] | None = None) -> nn.Module:
    """Fill ``model``'s parameters and persistent buffers, in place, from the checkpoint folder
    ``path``; of a parallelized model each rank reads only the bytes of its pieces. Every key,
    shape and dtype is checked against the files' headers before anything is read.

    ``stages``: the modules holding this rank's part of ``model`` under its FQNs (a pipeline's
    stages): only their tensors are filled, and ``model`` (on ``meta`` or not) names every key the
    checkpoint must have."""
    _load(model, checkpoint_entries(path), path, stages)
    return model


def held_tensors(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``stages`` by FQN, tied ones under each of their names."""
    return {fqn: t for stage in stages for fqn, t in [*stage.named_parameters(remove_duplicate=False),
                                                      *stage.named_buffers(remove_duplicate=False)]}


def tied_groups(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The keys of ``state`` (a ``state_dict(keep_vars=True)``) grouped by the tensor they name:
    tied parameters share one group, in the state dict's order."""
    groups: dict[int, list[str]] = {}
    for key, tensor in state.items():
        groups.setdefault(id(tensor), []).append(key)
    return list(groups.values())


def _load(model: nn.Module, entries: dict[str, Entry], path: str, stages: list[nn.Module] | None) -> None:
    reads = _matched(model, entries, path, None if stages is None else held_tensors(stages))
    fds = {file: os.open(file, os.O_RDONLY) for file in {leaf.file for _, source in reads for leaf in leaves(source)}}
    # one block buffer for every read: one freed per tensor would stay in the allocator's heap
    rows = [math.prod(leaf.shape[1:]) * leaf.dtype.itemsize for _, source in reads for leaf in leaves(source)]
    buffer = torch.empty(max([READ_BYTES, *rows]), dtype=torch.uint8)
    try:
        with torch.no_grad():
            for tensor, source in sorted(reads, key=lambda read: (leaves(read[1])[0].file, leaves(read[1])[0].offset)):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                _read_source(local.detach(), source, held_indices(tensor), fds, buffer)
    finally:
        for fd in fds.values():
            os.close(fd)
    for holder in [model] if stages is None else stages:
        state = sharded_state(holder)
        if state is not None:  # buffers built on the CPU go where the pieces are
            for module in holder.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None and buffer.device.type != state.mesh.device_type:
                        module._buffers[name] = buffer.to(state.mesh.device_type)


def _convertible(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether ``copy_`` keeps a value of ``source`` as a ``target`` one means it: no float into an
    integer or bool, no complex into a real."""
    if source.is_complex:
        return target.is_complex
    return not source.is_floating_point or target.is_floating_point or target.is_complex


def _matched(model: nn.Module, entries: dict[str, Entry], path: str, held: dict[str, torch.Tensor] | None
             ) -> list[tuple[torch.Tensor, Entry | Composite | Stretch]]:
    """(held tensor, its source: a checkpoint entry, or a ``Composite`` or ``Stretch`` of entries that
    transformers converts) for every parameter and persistent buffer of ``model`` (of them, those
    ``held`` holds by FQN, when given): tied ones once, from any of their keys the checkpoint has
    (transformers saves one). Every mismatch is raised at once, before anything is read."""
    state = model.state_dict(keep_vars=True)
    holder = state if held is None else held
    found, unexpected, refused = model_sources(model, entries, set(state))
    if refused:
        shown = "\n  ".join(refused[:CONVERTED_SHOWN])
        raise ValueError(f"checkpoint {path!r} is in a layout transformers converts while loading "
                         f"{type(model).__name__} (its conversion mapping) by operations that are not read piece by "
                         f"piece: {len(refused)} of the model's tensors, first\n  {shown}\nRead it once on one "
                         f"device with transformers' from_pretrained and write it with dtensor_par.save_pretrained, "
                         f"which writes the model's own keys")
    problems = [f"unexpected key {key!r} (not in the model)" for key in unexpected]
    reads = []
    for keys in tied_groups(state):
        mine = [key for key in keys if key in holder]
        if not mine:  # another rank's (a pipeline's other stages)
            continue
        present = [key for key in keys if key in found]
        if not present:
            problems.append(f"missing key {' or '.join(map(repr, keys))}")
            continue
        key, tensor = present[0], holder[mine[0]]
        source = found[key]
        dtypes = sorted({str(leaf.dtype) for leaf in leaves(source) if not _convertible(leaf.dtype, tensor.dtype)})
        if tensor.is_meta:
            problems.append(f"{key!r} is on meta: parallelize the model first (it materializes the pieces)")
        elif source.shape != tuple(tensor.shape):
            problems.append(f"{key!r} has shape {list(source.shape)} in the checkpoint, {list(tensor.shape)} in the "
                            f"model")
        elif dtypes:
            problems.append(f"{key!r} is {' and '.join(dtypes)} in the checkpoint, which does not convert to the "
                            f"model's {tensor.dtype}")
        else:
            reads.append((tensor, source))
    if problems:
        raise ValueError(f"checkpoint {path!r} does not fit {type(model).__name__}:\n  " + "\n  ".join(problems))
    return reads


def _pread(fd: int, into: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU tensor ``into`` with the file's bytes from ``offset``."""
    view = memoryview(into.reshape(-1).view(torch.uint8).numpy())
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise EOFError(f"file descriptor {fd} ended at byte {offset}")
        view, offset = view[n:], offset + n


def _read_source(local: torch.Tensor, source: Entry | Composite | Stretch, indices: list[torch.Tensor | None],
                 fds: dict[str, int], buffer: torch.Tensor) -> None:
    """Read this rank's piece of ``source`` (the global indices it holds along each dim:
    ``indices``) into ``local``. A ``Composite``'s piece maps dim by dim to pieces of its parts,
    each read into the view of ``local`` it lands in: a stack's held positions select parts, a
    concatenation's held indices fall in each part's stretch in runs. A ``Stretch``'s indices are
    its part's, moved by where it starts."""
    if isinstance(source, Stretch):
        dim, index = source.dim, indices[source.dim]
        held = torch.arange(source.shape[dim]) if index is None else index
        _read_source(local, source.part, [*indices[:dim], held + source.start, *indices[dim + 1:]], fds, buffer)
        return
    if not isinstance(source, Composite):
        _read_into(local, source, indices, fds[source.file], buffer)
        return
    dim, index = source.dim, indices[source.dim]
    if source.stack:
        rest = indices[:dim] + indices[dim + 1:]
        for at, part in enumerate(range(source.shape[dim]) if index is None else index.tolist()):
            _read_source(local.select(dim, at), source.parts[part], rest, fds, buffer)
        return
    start = 0
    for part in source.parts:
        size = part.shape[dim]
        if index is None:
            _read_source(local.narrow(dim, start, size), part, indices, fds, buffer)
        else:
            held = torch.nonzero((index >= start) & (index < start + size)).flatten()
            for first, stop in runs(held):
                within = [*indices[:dim], index[first:stop] - start, *indices[dim + 1:]]
                _read_source(local.narrow(dim, first, stop - first), part, within, fds, buffer)
        start += size


def _read_into(local: torch.Tensor, entry: Entry, indices: list[torch.Tensor | None], fd: int,
               buffer: torch.Tensor) -> None:
    """Read this rank's piece of ``entry`` into ``local``: runs of rows along dim 0 in blocks of
    at most ``READ_BYTES`` (``buffer``), each block's other dims selected (a view where they are
    one run: a column cut copies from the block with no copy of its own). Whole rows of the same
    dtype into a contiguous CPU piece are read straight into it, with no block."""
    if local.dim() == 0:
        local, indices, shape = local.view(1), [None], (1,)
    else:
        shape = entry.shape
    if local.numel() == 0:
        return
    row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
    rows_per_read = max(1, READ_BYTES // row_bytes)
    direct = (all(i is None for i in indices[1:]) and local.dtype == entry.dtype and local.device.type == "cpu"
              and local.is_contiguous())
    row = 0
    for first, stop in [(0, shape[0])] if indices[0] is None else runs(indices[0]):
        for start in range(first, stop, rows_per_read):
            n = min(stop, start + rows_per_read) - start
            offset = entry.offset + start * row_bytes
            if direct:
                _pread(fd, local[row:row + n], offset)
            else:
                block = buffer[:n * row_bytes].view(entry.dtype).view(n, *shape[1:])
                _pread(fd, block, offset)
                for dim, index in enumerate(indices[1:], 1):
                    cut = None if index is None else runs(index)
                    if cut is not None and len(cut) == 1:
                        block = block.narrow(dim, cut[0][0], cut[0][1] - cut[0][0])
                    elif cut is not None:
                        block = block.index_select(dim, index)
                local[row:row + n].copy_(block)
            row += n


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _size_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or "5GB" (10**9) / "5GiB" (2**30), as transformers reads it."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]I?B|B)\s*", size.upper())
    if match is None:
        raise ValueError(f"save_pretrained: max_shard_size {size!r} is not a size such as '5GB', '500MiB' or 10**9")
    return int(match[1]) * _UNITS[match[2]]


def _shards(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in order, cut into files of at most ``limit`` bytes (a larger tensor alone)."""
    shards, size = [[]], 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += nbytes
    return shards


def _header(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A safetensors header for ``tensors`` (global shapes: a DTensor's are known before any gather),
    padded to 8 bytes as safetensors pads it."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def save_pretrained(model: nn.Module, path: str, *, max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``model`` (parallelized or not) to the folder ``path`` as its library does: config
    (transformers' ``config.save_pretrained``, diffusers' ``save_config``) and safetensors under
    the model's own keys, tied parameters once, in numbered files with an index (one file when
    there is one writer and it fits ``max_shard_size``). Every rank calls it, and the ranks write
    in parallel (``write_parts``). Returns the files this rank wrote. A pipeline's step writes
    itself (``PipelineStep.save_pretrained``)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained writes an nn.Module, not a {type(model).__name__}; a pipeline's step "
                        f"writes its stages itself: step.save_pretrained(path)")
    state = model.state_dict(keep_vars=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return write_parts(model, path, max_shard_size, [Part([keys[0] for keys in tied_groups(state)],
                                                          list(range(world)), state)])


@dataclass
class Part:
    """Tensors of a model held, and written, by a group of ranks (the world; a pipeline stage's)."""

    keys: list[str]  # in the order they are written, tied parameters under one key
    ranks: list[int]  # the ranks that hold them, each a writer
    held: dict[str, torch.Tensor] | None  # the tensors by key as this rank holds them (None: not one of ranks)


def write_parts(model: nn.Module, path: str, max_shard_size: int | str, parts: list[Part]) -> list[str]:
    """``save_pretrained``'s files, written in parallel: each part's tensors, in order, are cut into
    one run of about equal bytes per rank of the part (``_writer_runs``), each run into files of at
    most ``max_shard_size`` (numbered in order across parts); a rank gathers each tensor of its
    runs from the ranks holding its pieces, alone, one tensor at a time, and writes its files;
    rank 0 writes the config and the index. ``model`` gives each key's shape and dtype (it may be
    on ``meta``). Returns the files this rank wrote."""
    limit = _size_bytes(max_shard_size)
    state = model.state_dict(keep_vars=True)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    writer_runs: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(world)]
    files = []  # (writer, its tensors), in the files' order
    for part in parts:
        tensors = [(key, state[key] if part.held is None else part.held[key]) for key in part.keys]
        if part.held is not None:
            _check_gatherable(tensors, len(part.ranks))
        for writer, run in zip(part.ranks, _writer_runs(tensors, len(part.ranks))):
            writer_runs[writer].extend(run)
            files.extend((writer, shard) for shard in _shards(run, limit) if shard)
    weights = WEIGHTS[1] if hasattr(model, "save_config") else WEIGHTS[0]
    stem = weights.removesuffix(".safetensors")
    names = [weights] if len(files) == 1 else [f"{stem}-{i:05d}-of-{len(files):05d}.safetensors"
                                                for i in range(1, len(files) + 1)]
    os.makedirs(path, exist_ok=True)
    if rank == 0:
        _write_config_and_index(model, path, weights, names, [shard for _, shard in files])
    mine = [(os.path.join(path, name), shard) for name, (writer, shard) in zip(names, files) if writer == rank]
    held = [(key, tensor) for part in parts if part.held is not None for key, tensor in part.held.items()]
    _write_runs(mine, writer_runs, _held_everywhere(held, world), rank)
    if dist.is_initialized():
        dist.barrier()  # the files are whole before any rank reads them
    return [file for file, _ in mine]


def _write_config_and_index(model: nn.Module, path: str, weights: str, names: list[str],
                            shards: list[list[tuple[str, torch.Tensor]]]) -> None:
    if hasattr(model, "save_config"):
        model.save_config(path)
    elif hasattr(getattr(model, "config", None), "save_pretrained"):
        model.config.save_pretrained(path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for shard in shards for _, t in shard)},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key, _ in shard}}
        with open(os.path.join(path, weights + ".index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def _cut_mesh_dims(tensor: torch.Tensor) -> list[int]:
    """The mesh dims a DTensor's pieces differ along (Shard, _StridedShard); none for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return []
    return [d for d, p in enumerate(tensor.placements) if isinstance(p, Shard | _StridedShard)]


def _check_gatherable(tensors: list[tuple[str, torch.Tensor]], ranks: int) -> None:
    """Refuse, on every rank that holds them alike and before anything is sent, a DTensor whose
    pieces do not add up to the whole (Partial: a sum still to take) or whose mesh is not the
    ``ranks`` that hold it (a pipeline stage's model: another stage's ranks hold none of its
    tensors)."""
    for key, tensor in tensors:
        if not isinstance(tensor, DTensor):
            continue
        dims = " x ".join(tensor.device_mesh.mesh_dim_names or ())
        if any(p.is_partial() for p in tensor.placements):
            raise ValueError(f"save_pretrained: {key!r} ({list(tensor.shape)}) is {list(tensor.placements)} on mesh "
                             f"dims {dims}: a Partial sum is not a value to write; redistribute it to Replicate or "
                             f"Shard first")
        if tensor.device_mesh.size() != ranks:
            raise ValueError(f"save_pretrained: {key!r} lives on a mesh of {tensor.device_mesh.size()} ranks "
                             f"({dims}), the world has {ranks}: every rank calls save_pretrained with the whole "
                             f"model (a pipeline stage's model is not written)")


def _writer_runs(tensors: list[tuple[str, torch.Tensor]], writers: int) -> list[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in order cut into ``writers`` runs, the largest as small as a cut in order
    allows (the least capacity a greedy fill packs them into ``writers`` runs with, searched by
    halving), none empty while tensors are left: each rank writes about its share of the bytes
    and the files keep the state dict's order."""
    sizes = [t.numel() * t.element_size() for _, t in tensors]

    def packed(capacity: int) -> list[list[tuple[str, torch.Tensor]]]:
        found, load = [[]], 0
        for i, (item, nbytes) in enumerate(zip(tensors, sizes)):
            if found[-1] and (load + nbytes > capacity or writers - len(found) >= len(tensors) - i):
                found.append([])
                load = 0
            found[-1].append(item)
            load += nbytes
        return found

    low, high = max(sizes, default=0), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(packed(middle)) <= writers else (middle + 1, high)
    found = packed(low)
    return found + [[] for _ in range(writers - len(found))]


def _held_everywhere(tensors: list[tuple[str, torch.Tensor]], world: int) -> list[dict[str, list]]:
    """For each rank, the ``held_runs`` of its piece of every cut DTensor, by key: what a writer
    needs to receive a piece (its shape) and place it (its blocks). One exchange for the model."""
    mine = {key: held_runs(tensor) for key, tensor in tensors if _cut_mesh_dims(tensor)}
    if world == 1:
        return [mine]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _senders(tensor: DTensor, writer: int) -> list[int]:
    """The ranks whose pieces of ``tensor`` make it whole for ``writer``: every coordinate along
    the mesh dims that cut it, the writer's own along the others (its own piece is not sent)."""
    ranks = tensor.device_mesh.mesh
    coordinate = (ranks == writer).nonzero()[0].tolist()
    cut = _cut_mesh_dims(tensor)
    return ranks[tuple(slice(None) if d in cut else c for d, c in enumerate(coordinate))].flatten().tolist()


def _write_runs(mine: list[tuple[str, list]], writer_runs: list[list[tuple[str, torch.Tensor]]],
                held: list[dict[str, list]], rank: int) -> None:
    """Write this rank's files (``mine``: file, its tensors) while sending the other writers the
    pieces they gather: in round ``i`` each writer gathers its run's tensor ``i`` (sends and
    receives of all writers at once, so no pair waits on another) and writes it. A writer holds
    one gathered tensor beyond its pieces at a time, plus one block buffer of ``READ_BYTES``."""
    files = iter(mine)
    file, f, left = None, None, 0
    buffer = torch.empty(READ_BYTES, dtype=torch.uint8)
    try:
        with torch.no_grad():
            for round_ in range(max(map(len, writer_runs))):
                jobs = [(writer, run[round_]) for writer, run in enumerate(writer_runs) if round_ < len(run)]
                pieces = _exchange(jobs, held, rank)
                if pieces is None:
                    continue
                if not left:
                    if f is not None:
                        f.close()
                    file, shard = next(files)
                    f, left = open(file, "wb"), len(shard)
                    f.write(_header(shard))
                _write_tensor(f, writer_runs[rank][round_][1], pieces, buffer)
                pieces, left = None, left - 1  # freed before the next round gathers
    finally:
        if f is not None:
            f.close()


def _exchange(jobs: list[tuple[int, tuple[str, torch.Tensor]]], held: list[dict[str, list]], rank: int
              ) -> list[tuple[torch.Tensor, list]] | None:
    """One round: each writer's tensor gathered to it alone. Returns this rank's pieces of its own
    tensor (piece, its held runs), None where it writes nothing this round."""
    ops, pieces = [], None
    for writer, (key, tensor) in jobs:
        if not _cut_mesh_dims(tensor):
            if writer == rank:
                pieces = [(tensor.to_local() if isinstance(tensor, DTensor) else tensor, None)]
            continue
        local = tensor.to_local().detach()
        if writer == rank:
            pieces = []
        for sender in _senders(tensor, writer):
            runs_ = held[sender][key]
            shape = [sum(stop - first for first, stop in dim) for dim in runs_]
            if math.prod(shape) == 0:
                continue
            if sender == writer == rank:
                pieces.append((local, runs_))
            elif writer == rank:
                pieces.append((torch.empty(shape, dtype=local.dtype, device=local.device), runs_))
                ops.append(dist.P2POp(dist.irecv, pieces[-1][0], sender))
            elif sender == rank:
                ops.append(dist.P2POp(dist.isend, local.contiguous(), writer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return pieces


def _write_tensor(f, tensor: torch.Tensor, pieces: list[tuple[torch.Tensor, list | None]], buffer: torch.Tensor
                  ) -> None:
    """Write the whole ``tensor`` (its bytes, row-major) from ``pieces``: one that is whole (runs
    None) as it is, else in blocks of rows assembled in ``buffer`` from every piece's blocks."""
    if len(pieces) == 1 and pieces[0][1] is None:
        f.write(pieces[0][0].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        return
    if tensor.numel() == 0:
        return
    shape, dtype = tuple(tensor.shape), tensor.dtype
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    if row_bytes > buffer.numel():
        buffer = torch.empty(row_bytes, dtype=torch.uint8)
    rows = buffer.numel() // row_bytes
    blocks = [(piece, piece_blocks(runs_)) for piece, runs_ in pieces]
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        staging = buffer[:(stop - start) * row_bytes]
        rows_view = staging.view(dtype).view(stop - start, *shape[1:])
        for piece, its_blocks in blocks:
            for offsets, sizes, at in its_blocks:
                first, last = max(start, offsets[0]), min(stop, offsets[0] + sizes[0])
                if first >= last:
                    continue
                target = rows_view[first - start:last - start]
                source = piece.narrow(0, at[0] + first - offsets[0], last - first)
                for dim in range(1, len(shape)):
                    target = target.narrow(dim, offsets[dim], sizes[dim])
                    source = source.narrow(dim, at[dim], sizes[dim])
                target.copy_(source)
        f.write(staging.numpy().data)
