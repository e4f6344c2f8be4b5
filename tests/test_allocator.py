"""The CUDA caching-allocator model, on the cases CUDACachingAllocator.cpp documents.

These check the model's rules one by one; its agreement with a real GPU's
``max_memory_allocated`` is measured by benchmarks/gpu_check.py."""

from vramledger.record.allocator import CUDA_CACHING_ALLOCATOR, CudaCachingAllocatorSim, round_up

MIB = 1024**2


def test_small_requests_round_to_512_bytes_in_2_mib_segments():
    sim = CudaCachingAllocatorSim()
    a = sim.malloc(100)
    b = sim.malloc(513)
    assert (a.size, b.size) == (512, 1024)
    assert sim.allocated == 1536
    assert sim.reserved == 2 * MIB  # one small segment serves both


def test_large_request_takes_whole_segment_when_remainder_is_at_most_1_mib():
    sim = CudaCachingAllocatorSim()
    block = sim.malloc(int(11.5 * MIB))  # segment rounded to 12 MiB, 0.5 MiB left: not split
    assert block.size == 12 * MIB
    assert sim.allocated == sim.reserved == 12 * MIB


def test_medium_requests_share_a_20_mib_segment():
    sim = CudaCachingAllocatorSim()
    a = sim.malloc(3 * MIB)
    b = sim.malloc(4 * MIB)
    assert (a.size, b.size) == (3 * MIB, 4 * MIB)
    assert sim.reserved == 20 * MIB


def test_freed_blocks_are_reused_best_fit_and_unsplit_when_remainder_small():
    sim = CudaCachingAllocatorSim()
    big = sim.malloc(int(2.4 * MIB))
    sim.malloc(17 * MIB)  # fills the rest of the 20 MiB segment
    sim.free(big)
    again = sim.malloc(int(1.5 * MIB))  # 2.4 MiB block, 0.9 MiB would remain: not split
    assert again.size == round_up(int(2.4 * MIB), 512) == big.size
    assert sim.reserved == 20 * MIB


def test_free_merges_neighbours():
    sim = CudaCachingAllocatorSim()
    a, b = sim.malloc(2 * MIB), sim.malloc(2 * MIB)
    sim.free(a)
    sim.free(b)
    whole = sim.malloc(18 * MIB)  # fits the segment only if a, b and the rest merged back
    assert sim.reserved == 20 * MIB  # no new segment
    assert whole.size == 18 * MIB  # 2 MiB remain (> 1 MiB): split


def test_zero_byte_storages_and_host_storages_take_nothing():
    sizes, reserved = CUDA_CACHING_ALLOCATOR.block_sizes(
        [0, 100, 100], [0, 1, 2], [False, False, True]
    )
    assert sizes[2] == 0 and reserved[-1] == 2 * MIB
