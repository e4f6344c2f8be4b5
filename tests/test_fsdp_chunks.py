"""FSDP2's chunks of fake parameters made when read (``parallel/fsdp_chunks.py``) are the chunks
FSDP2's own ``_chunk_with_empty`` makes: the same count, and each the same view."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

from vramledger.parallel.fsdp_chunks import LazyChunks, lazy_chunks


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device)


@pytest.mark.parametrize("shape", [(1,), (3,), (64,), (65,), (127, 5), (4096, 8), (7, 64, 3)])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 8, 64, 200])
def test_lazy_chunks_are_fsdps_chunks(shape, num_chunks):
    with FakeTensorMode():
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        for dim in range(len(shape)):
            expected = _chunk_with_empty(tensor, num_chunks, dim)
            lazy = LazyChunks(tensor, num_chunks, dim)
            assert len(lazy) == len(expected) == num_chunks
            assert [_layout(c) for c in lazy] == [_layout(c) for c in expected]
            assert _layout(lazy[-1]) == _layout(expected[-1])
            assert [_layout(c) for c in lazy[1:3]] == [_layout(c) for c in expected[1:3]]
            with pytest.raises(IndexError):
                lazy[num_chunks]


def test_only_fake_tensors_are_chunked_lazily():
    real = torch.zeros(10, 4)
    with lazy_chunks():
        chunks = _fsdp_param._chunk_with_empty(real, 4, 0)
        assert isinstance(chunks, list)  # FSDP2's own function
        with FakeTensorMode():
            fake = torch.empty(10, 4)
            assert isinstance(_fsdp_param._chunk_with_empty(fake, 4, 0), LazyChunks)
    assert _fsdp_param._chunk_with_empty is _chunk_with_empty  # restored
