"""Which tensors of a checkpoint make each tensor of a model: its keys as they are, with the
model's ``base_model_prefix`` added or removed, or renamed and converted by transformers 5's
conversion mapping (``get_model_conversion_mapping``), as its own ``from_pretrained`` reads them.

A converted tensor is described, not built: a ``Composite`` of the files' tensors, stacked
(``MergeModulelist``: Mixtral's per-expert ``w1``, one tensor per expert) and concatenated
(``Concatenate``: ``w1`` beside ``w3`` into ``gate_up_proj``), nested; or a ``Stretch`` of one
(``Chunk``: Dinov2's SwiGLU ``weights_in`` into ``gate_proj`` and ``up_proj``). A rank's piece of
it then maps to pieces of the files' tensors, each read alone (``checkpoints._read_source``): no
rank ever holds a whole converted tensor. Other operations (a transpose, a split by the model's
sizes, an interleave) are refused, naming the operation and the keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class Composite:
    """A model tensor built from ``parts`` (the files' entries or composites): stacked along a
    new ``dim`` (``stack``) or concatenated along ``dim``; ``shape`` is the result's."""

    stack: bool
    dim: int
    parts: tuple
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Stretch:
    """A model tensor that is the stretch of ``part`` (an entry or a ``Composite``) along ``dim``
    from ``start``; ``shape`` is the stretch's."""

    part: object
    dim: int
    start: int
    shape: tuple[int, ...]


def leaves(source) -> list:
    """The files' entries a source (an entry, a ``Composite`` or a ``Stretch``) is made of, in order."""
    if isinstance(source, Composite):
        return [leaf for part in source.parts for leaf in leaves(part)]
    return leaves(source.part) if isinstance(source, Stretch) else [source]


def _stacked(parts: list, dim: int) -> Composite | str:
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        return f"stacks tensors of shapes {sorted(map(list, shapes))}"
    shape = list(shapes.pop())
    return Composite(True, dim, tuple(parts), tuple(shape[:dim] + [len(parts)] + shape[dim:]))


def _joined(parts: list, dim: int) -> Composite | str:
    rest = {tuple(s for d, s in enumerate(p.shape) if d != dim) for p in parts}
    if len(rest) != 1 or any(len(p.shape) <= dim for p in parts):
        return f"concatenates tensors of shapes {[list(p.shape) for p in parts]} along dim {dim}"
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return Composite(False, dim, tuple(parts), tuple(shape))


def _chunked(source, dim: int, count: int) -> list[Stretch] | str:
    """``source`` cut along ``dim`` into ``count`` equal stretches, as ``torch.chunk`` cuts it."""
    if len(source.shape) <= dim or source.shape[dim] % count:
        return f"cuts a tensor of shape {list(source.shape)} along dim {dim} into {count} unequal parts"
    size = source.shape[dim] // count
    shape = (*source.shape[:dim], size, *source.shape[dim + 1:])
    return [Stretch(source, dim, i * size, shape) for i in range(count)]


def _converted(converter, keys: dict[str, list[str]], entries: dict) -> list | str:
    """The sources ``converter``'s operations build from the checkpoint ``keys`` (by source
    pattern), one per target pattern, as its ``convert`` does: each pattern's tensors in the order
    transformers collects them (``dot_natural_key``), ``Concatenate`` in the converter's pattern
    order, a last ``Chunk`` into one stretch per target; else why not."""
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, dot_natural_key

    values = {p: [entries[k] for k in sorted(found, key=dot_natural_key)] for p, found in keys.items()}
    # targets named with a backreference (\1) are renamed otherwise than ``model_sources`` does
    literal_targets = not any("\\" in t for t in converter.target_patterns)
    chunks = None
    for op in converter.operations:
        if type(op) is MergeModulelist:  # a subclass may convert otherwise: refused by its name
            values = {p: _stacked(v, op.dim) if isinstance(v, list) else v for p, v in values.items()}
        elif type(op) is Concatenate:
            parts = [part for p in converter.source_patterns if p in values
                     for part in (values[p] if isinstance(values[p], list) else [values[p]])]
            values = {"": _joined(parts, op.dim)}
        elif type(op) is Chunk and op is converter.operations[-1] and op.num_shards_attribute is None \
                and _one(values) is not None and literal_targets:
            chunks = _chunked(_one(values), op.dim, len(converter.target_patterns))
            values = {"": chunks}
        else:
            return f"is made by transformers' {op!r}, which is not read piece by piece"
        problem = next((v for v in values.values() if isinstance(v, str)), None)
        if problem is not None:
            return f"is made by transformers' {op!r}, which {problem}"
    made = chunks or [_one(values)]
    if made[0] is None or len(made) != len(converter.target_patterns):
        return f"is made by transformers' {converter.operations!r} into several tensors, not read piece by piece"
    return made


def _one(values: dict):
    """The one tensor ``values`` holds (by source pattern, each a tensor or a list), or None."""
    value = next(iter(values.values()))
    if len(values) != 1 or isinstance(value, list) and len(value) != 1:
        return None
    return value[0] if isinstance(value, list) else value


def _key_mapping(model: nn.Module, keys, found):
    """How checkpoint keys name the model's: as they are, or with the model's
    ``base_model_prefix`` added or removed (a base model's checkpoint into a model with a head,
    and back, as transformers loads them), whichever names most."""
    prefix = getattr(model, "base_model_prefix", "")
    candidates = [lambda k: k]
    if prefix:
        candidates += [lambda k: f"{prefix}.{k}", lambda k: k.removeprefix(f"{prefix}.")]
    return max(candidates, key=lambda rename: len(keys & {rename(k) for k in found}))


def _transformers_renaming(model: nn.Module):
    """transformers 5's renaming of a checkpoint key for ``model`` by its conversion mapping:
    ``key -> (renamed key, the converter's source pattern or None, the converter or None)``; the
    identity for other models (and other transformers versions)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: (key, None, None)
    if not hasattr(model, "_from_config"):
        return lambda key: (key, None, None)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    def rename(key: str):
        renamed, pattern = rename_source_key(key, renamings, converters)
        return renamed, pattern, by_pattern.get(pattern)
    return rename


CONVERTED_SHOWN = 4
"""How many refused converted keys an error names."""


def model_sources(model: nn.Module, entries: dict, keys: set[str]) -> tuple[dict, list[str], list[str]]:
    """Each model key's source among the checkpoint's ``entries`` (by key): an entry, or a
    ``Composite`` of entries where transformers' conversion mapping builds the tensor; then the
    checkpoint keys that name no model key (unexpected), and the conversions refused (naming
    their operation and keys). A renamed key the model does not have falls back to the key as
    it is, as transformers' loading does."""
    transformers_rename = _transformers_renaming(model)
    renamed = {key: transformers_rename(key) for key in entries}
    prefix = _key_mapping(model, keys, [name for name, _, _ in renamed.values()])
    sources, converted, unexpected = {}, {}, []
    for key, (name, pattern, converter) in renamed.items():
        target = prefix(name)
        if target not in keys and prefix(key) in keys:
            target, converter = prefix(key), None
        if target not in keys:
            unexpected.append(key)
        elif converter is None:
            sources[target] = entries[key]
        else:
            converted.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
    refused = []
    for target, (converter, by_pattern) in converted.items():
        made = _converted(converter, by_pattern, entries)
        if isinstance(made, str):
            keys = sorted(key for found in by_pattern.values() for key in found)
            more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
            refused.append(f"{target!r} (from {keys[0]!r}{more}) {made}")
        else:
            # transformers names a one-to-many conversion's key by its first target (rename_source_key)
            first = converter.target_patterns[0]
            sources.update({target.replace(first, pattern, 1): source
                            for pattern, source in zip(converter.target_patterns, made)})
    return sources, unexpected, refused
