"""The DCP all-gather across GPUs of one host, one process per GPU, over each transport (NCCL,
and copy engines pulling from the peers' rings in symmetric memory): the kernel and
KVPrefetcher, eagerly (with a sleep before every gather, slots poisoned after use) and replayed
from a CUDA graph; every gathered slot must equal the full KV a single GPU would hold. ``auto``
must time both and record its choice in the plan. Skipped unless the machine has the GPUs
(nvidia-h200-x2 / -x4); a world of one runs anywhere."""

import pytest
import torch

pytestmark = pytest.mark.cuda


def _rank(rank: int, world: int, transport: str) -> None:
    import torch.distributed as dist

    from ringflow.testing.dcp import ROW, full_kv, shard
    from ringflow.integrations.torch.kv_prefetch import DcpGroup, KVLayout, KVPrefetcher, KVSource
    from ringflow.kernels import dcp_all_gather, dcp_gather, dcp_slot_rows
    from ringflow.kernels.peer_exchange import symmetric_exchange

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    lane = dist.new_group(list(range(world)))       # the gather lane's own communicator
    batch, context, layers = 3, 5000 + 7, 4         # not divisible by the group size
    fulls = [full_kv(batch, context, seed, device) for seed in (1, 2)]
    shards = [shard(f, batch, context, rank, world) for f in fulls]
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    rows = dcp_slot_rows(batch * context, batch, world)  # each request from a multiple of world
    step = -(-context // world) * world
    wants = [torch.zeros(rows, ROW, dtype=torch.bfloat16, device=device) for _ in fulls]
    for want, full in zip(wants, fulls):
        for r in range(batch):
            want[r * step: r * step + context] = full[r * context: (r + 1) * context]

    # the kernel alone, on a side stream, then replayed from a graph
    if transport == "peer":  # no staging: the peers' rows land in order
        # a small tensor in torch's implicit symmetric pool first: a ring carved from the same
        # pool would start partway into its block, where get_buffer's offsets do not count
        # from (Note [Peer exchange]); the ring must be a block of its own
        from torch.distributed import _symmetric_memory as symm_mem
        neighbour = symm_mem.empty(4096, dtype=torch.bfloat16, device=device)  # noqa: F841
        exchange = symmetric_exchange((rows, ROW), torch.bfloat16, device, lane)
        slot = exchange.storage.fill_(float("nan"))

        def gather(cache, table):
            dcp_gather(cache, table, lens, slot, None, exchange)
    else:
        local = rows // world
        slot = torch.full((rows + world * local, ROW), float("nan"), dtype=torch.bfloat16,
                          device=device)

        def gather(cache, table):
            dcp_all_gather(cache, table, lens, slot[:rows], slot[rows:].view(world, local, ROW),
                           lane)
    torch.cuda.synchronize()
    dist.barrier(lane)  # every rank's ring is NaN before anyone pulls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000 * (rank + 1))  # ranks arrive at different times
        gather(*shards[0])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(slot[:rows], wants[0]), f"rank {rank}: eager {transport} gather"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(200_000 * (world - rank))
        gather(*shards[1])
    torch.cuda.synchronize()
    dist.barrier(lane)
    slot.fill_(float("nan"))
    torch.cuda.synchronize()
    dist.barrier(lane)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(slot[:rows], wants[1]), f"rank {rank}: captured {transport} gather"

    # the prefetcher: layer l reads cache l % 2, one layer ahead, eager then captured
    layout = KVLayout("rows", (ROW,), torch.bfloat16, 64)
    pf = KVPrefetcher(layout, batch * context, max_requests=batch, depth=1, workspace_bytes=1 << 34,
                      device=device, dcp=DcpGroup(lane, world, rank, transport=transport),
                      poison=True, name="dcp")
    pf.plan(layers)
    meta = pf.dag.meta["dcp"]
    if transport == "auto":
        assert set(meta["measured_ms"]) == {"nccl", "peer"}, meta
        ms = meta["measured_ms"]
        assert meta["transport"] == ("peer" if ms["peer"] <= 1.10 * ms["nccl"] else "nccl"), meta
    else:  # no silent fallback on GPUs that can map each other's memory
        assert meta["transport"] == pf.transport.name == transport, meta
    assert pf.capacity == rows and (pf.local_capacity == 0) == (transport == "peer")
    pf.gather_hook = lambda: torch.cuda._sleep(200_000 * (rank + 1))  # ranks out of step
    seen = torch.empty(layers, rows, ROW, dtype=torch.bfloat16, device=device)

    def source(layer):
        cache, table = shards[layer % 2]
        return KVSource(cache, table, lens, batch * context)

    def forward():
        for layer in range(layers):
            pf.begin(layer, source)
            seen[layer].copy_(pf.gathered(layer)[:rows])
            pf.end(layer)

    forward()
    torch.cuda.synchronize()
    for layer in range(layers):
        assert torch.equal(seen[layer], wants[layer % 2]), f"rank {rank}: eager layer {layer}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        seen.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(seen[layer], wants[layer % 2]), f"rank {rank}: replay, {layer}"


@pytest.mark.parametrize("transport", ["nccl", "peer", "auto"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_dcp_gather_across_gpus_equals_the_full_kv(tmp_path, world, transport):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs of one host (device kinds nvidia-h200-x{world}); this "
                    f"machine has {torch.cuda.device_count()}")
    if world == 1 and transport != "nccl":
        pytest.skip("a group of one exchanges nothing")
    from ringflow.testing.spawn import spawn_group
    spawn_group(world, _rank, transport, backend="nccl", rendezvous=str(tmp_path / "rdzv"))


def _block_rank(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed import _symmetric_memory as symm_mem

    from ringflow.kernels.peer_exchange import symmetric_exchange

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    # a tensor of torch's implicit pool first: a ring carved from that pool would start
    # partway into its block, and get_buffer would map the block's start instead
    neighbour = symm_mem.empty(4096, dtype=torch.bfloat16, device=device)
    neighbour.fill_(-1.0)
    rings = [symmetric_exchange((257, 64), torch.bfloat16, device, group) for _ in range(2)]
    for i, ring in enumerate(rings):
        ring.storage.copy_(torch.arange(257 * 64, device=device).view(257, 64)
                           .to(torch.bfloat16) + 1000 * rank + 100 * i)
    torch.cuda.synchronize()
    dist.barrier(group)
    for i, ring in enumerate(rings):
        part = ring.storage[3:200]
        for peer in range(world):  # every rank's ring, as this rank maps it, byte for byte
            want = (torch.arange(257 * 64, device=device).view(257, 64).to(torch.bfloat16)
                    + 1000 * peer + 100 * i)[3:200]
            assert torch.equal(ring.remote(peer, part), want), f"rank {rank} ring {i} peer {peer}"
        ring.barrier()  # each ring's barrier runs on its own signal pad
    torch.cuda.synchronize()
    assert bool((neighbour == -1.0).all())


@pytest.mark.parametrize("world", [1, 2])
def test_each_ring_is_a_symmetric_block_of_its_own_that_every_rank_maps(tmp_path, world):
    """Note [Peer exchange]: a ring at offset 0 of a block of its own, next to a tensor of
    torch's implicit pool, so that ``remote`` reads exactly the ring's bytes on every rank (on
    one GPU: its own, mapped back through the symmetric handle)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs of one host (nvidia-h200-x{world}); this machine has "
                    f"{torch.cuda.device_count()}")
    from ringflow.testing.spawn import spawn_group
    spawn_group(world, _block_rank, backend="nccl", rendezvous=str(tmp_path / "rdzv"))
