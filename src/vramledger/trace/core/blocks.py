"""Identical repeated blocks: trace a few, extend to all, exactly.

A 70B model is 80 identical decoder layers. Tracing every one costs time and tells nothing new:
the events of layer 40 are those of layer 39 with the names shifted. So the trace runs the
model with ``SMALL`` and ``SMALL + 1`` blocks, every event labelled with the block it belongs
to (module hooks in forward, gradient hooks on block boundaries in backward, the owning
parameter in the optimizer step). In each stretch of the timeline that walks the blocks in order
(a *region*: the forward, the backward, each multi-tensor optimizer operator ...; found by
``block_regions.py``), the events of a middle block (``HEAD``) are the template for every middle
block — the first ``HEAD`` blocks and the last are kept as traced; storages a block references
in other blocks or regions are kept at the same relative block offset. ``extend`` rebuilds the
timeline for any depth from the small one.

Exactness is checked, not assumed: the timeline extended from ``SMALL`` to ``SMALL + 1`` blocks
must equal the traced ``SMALL + 1`` timeline event for event — storages, sizes, categories,
modules, operators, frees — or the trace falls back to running every block. Models whose blocks
differ (alternating layer types, a bias computed in the first layer and shared, encoder and
decoder stacks) fail that check and are traced in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from vramledger.inputs.gc_pause import gc_paused
from vramledger.inputs.notes import Note, Topic
from vramledger.record.timeline import Timeline
from vramledger.trace.core.block_regions import NotExtensible, Region, find_regions

SMALL = 4
"""Blocks in the smaller trace."""
HEAD = 2
"""Leading blocks kept as traced. The first block differs from the rest (the first cuBLAS call,
nothing to free from a previous block) and under FSDP the second does too (no block before the
first is prefetched). Block ``HEAD`` is the template for the middle ones; the last block is kept
as traced too."""
MIN_BLOCKS = SMALL + 3
"""Extend only models with at least this many blocks (otherwise a full trace is as cheap)."""


@dataclass(frozen=True)
class BlockStack:
    fqn: str
    """Name of the ModuleList holding the blocks (e.g. 'model.layers')."""
    length: int


def find_block_stack(model: nn.Module, min_blocks: int = MIN_BLOCKS) -> BlockStack | None:
    """The ModuleList of identical blocks (same class, same parameter names, shapes, dtypes and
    trainability: ``--freeze`` may freeze some blocks only), if exactly one such list has at
    least ``min_blocks`` entries."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < min_blocks:
            continue
        first = module[0]
        shape = _signature(first)
        if all(type(b) is type(first) and _signature(b) == shape for b in module):
            found.append(BlockStack(fqn=name, length=len(module)))
    return found[0] if len(found) == 1 else None


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters()
    )


def truncate(model: nn.Module, stack: BlockStack, depth: int) -> None:
    """Keep the first ``depth`` blocks (Python models, whose config we cannot rewrite)."""
    parent_name, _, attr = stack.fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    blocks = getattr(parent, attr)
    setattr(parent, attr, nn.ModuleList(list(blocks)[:depth]))


# -- the timeline surgery ---------------------------------------------------------------------
def _block_offset(module: str | None, prefix: str, block: int) -> tuple[int, str] | None:
    """Where a module name in ``prefix``'s blocks is relative to ``block``: (offset, the rest of
    the name), so that a name in block ``block + d`` (FSDP prefetching the next block's
    parameters, say) can be written for any block as ``prefix.{new + d}{rest}``; None for a
    name outside the blocks."""
    if module is None or not module.startswith(prefix + "."):
        return None
    index, dot, tail = module[len(prefix) + 1 :].partition(".")
    if not index.isdigit():
        return None
    return int(index) - block, dot + tail


def _relative(module: str | None, prefix: str, block: int) -> str | None:
    """A module name with its block written relative to ``block`` (``prefix.@+1.mlp``), for
    identities that must not depend on the block."""
    found = _block_offset(module, prefix, block)
    return module if found is None else f"{prefix}.@{found[0]:+d}{found[1]}"


@gc_paused()  # hundreds of thousands of tuples, no cycles
def extend(
    tl: Timeline,
    blocks: int,
    depth: int,
    prefix: str,
    origins: list[tuple[int, int]] | None = None,
) -> Timeline:
    """The timeline of the same run with ``depth`` blocks instead of ``blocks``. ``origins``,
    when given, receives for each event of the result the event of ``tl`` it was copied from
    and the block it was emitted as (-1 outside every region): where a moment of the small
    run lies in the extended one (``program_blocks.ExtendedCounter``)."""
    if blocks < HEAD + 2:
        raise NotExtensible(f"need at least {HEAD + 2} traced blocks")
    return _Extension(tl, blocks, depth, prefix).run(origins)


class _Extension:
    """One :func:`extend`: the traced timeline's regions, where each of their storages was
    allocated, and the extended timeline being written."""

    def __init__(self, tl: Timeline, blocks: int, depth: int, prefix: str) -> None:
        self.tl, self.blocks, self.depth, self.prefix = tl, blocks, depth, prefix
        self.regions = find_regions(tl, blocks, HEAD)
        self.where = _allocated_where(tl, self.regions, blocks, prefix)
        self.out = Timeline()
        self.new_sid: dict[Any, int] = {}
        self.mark_at: dict[int, list[tuple[int, Any]]] = {}
        for index, step, phase in tl.marks:
            self.mark_at.setdefault(index, []).append((step, phase))

    def run(self, origins: list[tuple[int, int]] | None) -> Timeline:
        tl, out, regions, depth, blocks = self.tl, self.out, self.regions, self.depth, self.blocks
        region_starts = {reg.start: r for r, reg in enumerate(regions)}
        e = 0
        n = len(tl.events)
        while e <= n:
            for step, phase in self.mark_at.get(e, ()):
                out.mark(step, phase)
            if e == n:
                break
            if e in region_starts:
                r = region_starts[e]
                region = regions[r]
                order = range(depth) if region.ascending else range(depth - 1, -1, -1)
                templates: dict[int, list[tuple[Any, ...]]] = {}
                for j in order:
                    source = j if j < HEAD else blocks - 1 if j == depth - 1 else HEAD
                    pos = source if region.ascending else blocks - 1 - source
                    if source not in templates:
                        templates[source] = self.chunk_template(r, *region.chunks[pos], source)
                    self.emit_chunk(templates[source], j)
                    if origins is not None:
                        origins.extend((ee, j) for ee in range(*region.chunks[pos]))
                e = region.stop
                continue
            self.emit_outside(e)
            if origins is not None:
                origins.append((e, -1))
            e += 1
        return out

    def outside_module(self, module: str | None) -> str | None:
        """The module of an allocation outside every region: one in the first blocks as it
        is, one in the last renumbered as the new last (FSDP's unsharding for the last block's
        backward runs in a hook of its output's autograd node, before its block label)."""
        found = _block_offset(module, self.prefix, 0)
        if found is None or found[0] < HEAD:
            return module
        if found[0] == self.blocks - 1:
            return f"{self.prefix}.{self.depth - 1}{found[1]}"
        raise NotExtensible("an event outside the blocks belongs to a middle block's module")

    def emit_outside(self, e: int) -> None:
        """An event outside every region, copied as it is; a free there, or the module of an
        allocation there, may refer only to the first blocks (kept as traced) or to the last
        (renumbered as the new last)."""
        tl, out, new_sid = self.tl, self.out, self.new_sid
        ev = tl.events[e]
        if ev >= 0:
            step, phase = tl.origin[ev]
            nsid = out.new_storage(
                tl.nbytes[ev],
                step,
                phase,
                self.outside_module(tl.module[ev]),
                tl.op[ev],
                None,
                recomputed=tl.recomputed[ev],
            )
            out.tags[nsid] = tl.tags[ev]
            out.on_host[nsid] = tl.on_host[ev]
            if ev in tl.labels:
                out.labels[nsid] = tl.labels[ev]
            new_sid[("outside", ev)] = nsid
            return
        sid = ~ev
        key: tuple[Any, ...] = ("outside", sid)
        if sid in self.where:
            r, k, o = self.where[sid]
            if k < HEAD:
                key = (r, k, o)
            elif k == self.blocks - 1:
                key = (r, self.depth - 1, o)
            else:
                raise NotExtensible("an event outside the blocks refers to a middle block")
        if key not in new_sid:
            raise NotExtensible(f"reference to {key} before its allocation")
        out.free(new_sid[key], None)

    def chunk_template(self, r: int, a: int, b: int, source: int) -> list[tuple[Any, ...]]:
        """The events of block ``source``'s chunk ``[a, b)`` of region ``r``, made ready to emit
        as any block, with every lookup that does not depend on the block done once (an 80-block
        model emits the middle block's chunk 76 times)."""
        tl, where, mark_at, prefix = self.tl, self.where, self.mark_at, self.prefix
        items: list[tuple[Any, ...]] = []
        for ee in range(a, b):
            if ee != a and ee in mark_at:
                raise NotExtensible("a phase changes inside a block")
            ev = tl.events[ee]
            if ev >= 0:
                module = tl.module[ev]
                offset, suffix = _block_offset(module, prefix, source) or (None, "")
                step, phase = tl.origin[ev]
                rr, _, identity = where.get(ev, (None, None, None))
                items.append(
                    (
                        True,
                        tl.nbytes[ev],
                        tl.tags[ev],
                        tl.on_host[ev],
                        module,
                        tl.recomputed[ev],
                        offset,
                        suffix,
                        tl.op[ev],
                        (step, phase),
                        tl.labels.get(ev),
                        ("outside", ev) if identity is None else None,
                        rr,
                        identity,
                    )
                )
            else:
                sid = ~ev
                if sid in where:
                    rr, k, o = where[sid]
                    items.append((False, None, rr, k - source, o))
                else:
                    if source == HEAD:
                        raise NotExtensible(
                            "a middle block frees a storage from outside the blocks"
                        )
                    items.append((False, ("outside", sid), None, None, None))
        return items

    def emit_chunk(self, items: list[tuple[Any, ...]], j: int) -> None:
        """Every event of a chunk template, as block ``j``."""
        out, new_sid, prefix = self.out, self.new_sid, self.prefix
        nbytes, tags, on_host, module_of, recomputed, ops = (
            out.nbytes,
            out.tags,
            out.on_host,
            out.module,
            out.recomputed,
            out.op,
        )
        origin, block, events, event_block = out.origin, out.block, out.events, out.event_block
        for item in items:
            if item[0]:
                (
                    _,
                    size,
                    tag,
                    host,
                    module,
                    again,
                    offset,
                    suffix,
                    op,
                    when,
                    label,
                    outside,
                    rr,
                    ident,
                ) = item
                nsid = len(nbytes)
                nbytes.append(size)
                tags.append(tag)
                on_host.append(host)
                module_of.append(module if offset is None else f"{prefix}.{j + offset}{suffix}")
                recomputed.append(again)
                ops.append(op)
                origin.append(when)
                block.append(j)
                events.append(nsid)
                event_block.append(j)
                if label is not None:
                    out.labels[nsid] = label
                new_sid[outside if ident is None else (rr, j, ident)] = nsid
            else:
                _, outside, rr, shift, o = item
                key = outside if outside is not None else (rr, j + shift, o)
                if key not in new_sid:
                    raise NotExtensible(f"reference to {key} before its allocation")
                events.append(~new_sid[key])
                event_block.append(j)


def _allocated_where(
    tl: Timeline, regions: list[Region], blocks: int, prefix: str
) -> dict[int, tuple[int, int, tuple[Any, ...]]]:
    """Where each storage was allocated, inside a region: (region, block, identity in the
    block), the identity being (operator, module relative to the block, bytes, occurrence) so
    that a block with an extra storage (the first one allocates the cuBLAS workspace) does not
    shift the identities of the others."""
    where: dict[int, tuple[int, int, tuple[Any, ...]]] = {}
    for r, region in enumerate(regions):
        order = range(blocks) if region.ascending else range(blocks - 1, -1, -1)
        for k, (a, b) in zip(order, region.chunks, strict=True):
            seen: dict[tuple[Any, ...], int] = {}
            for e in range(a, b):
                ev = tl.events[e]
                if ev >= 0:
                    base = (
                        tl.op[ev],
                        _relative(tl.module[ev], prefix, k),
                        tl.nbytes[ev],
                        tl.labels.get(ev),
                    )
                    seen[base] = seen.get(base, 0) + 1
                    where[ev] = (r, k, (*base, seen[base]))
    return where


RECORDED_COLUMNS = (
    "nbytes",
    "tags",
    "on_host",
    "module",
    "recomputed",
    "op",
    "origin",
    "labels",
    "events",
    "marks",
)
"""What a trace recorded, block labels aside: an extended trace must equal a full one in each."""


def same_timeline(a: Timeline, b: Timeline) -> bool:
    return a.same_as(b, RECORDED_COLUMNS)


def extended_counts(
    small: tuple[int, int], following: tuple[int, int], length: int
) -> tuple[int, int]:
    """(parameters, trainable parameters) of the model at ``length`` blocks, from its counts at
    ``SMALL`` and ``SMALL + 1``: identical blocks each add what the one beyond ``SMALL`` did."""
    extra = length - (SMALL + 1)
    return (
        following[0] + extra * (following[0] - small[0]),
        following[1] + extra * (following[1] - small[1]),
    )


def extension_note(fqn: str, length: int, *, verified_elsewhere: bool = False) -> str:
    """What an extended trace says of how it was made, the estimate's and a program's alike.
    ``verified_elsewhere``: only ``SMALL`` blocks were traced, the extension having been shown
    exact on the same run at another data-parallel or tensor-parallel degree, offload setting,
    micro-batch or sequence length."""
    if verified_elsewhere:
        return Note(
            Topic.EXTENT,
            f"traced {SMALL} of the {length} identical blocks in {fqn} and extended "
            "the timeline to all of them (the extension was verified exact on this run at another "
            "data-parallel or tensor-parallel degree, offload setting, micro-batch or sequence "
            f"length: extending its {SMALL}-block trace reproduced its {SMALL + 1}-block trace)",
        )
    return Note(
        Topic.EXTENT,
        f"traced {SMALL} and {SMALL + 1} of the {length} identical blocks in {fqn} and "
        "extended the timeline to all of them (verified exact on the smaller pair)",
    )
