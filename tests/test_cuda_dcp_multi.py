"""The DCP all-gather on real NCCL across GPUs of one host, one process per GPU: the kernel and
KVPrefetcher, eagerly (with a sleep before every gather, slots poisoned after use) and replayed
from a CUDA graph; every gathered slot must equal the full KV a single GPU would hold. Skipped
unless the machine has the GPUs (nvidia-h200-x2 / -x4); a world of one runs anywhere."""

import pytest
import torch

pytestmark = pytest.mark.cuda


def _rank(rank: int, world: int) -> None:
    import torch.distributed as dist

    from ringflow.dcp_bench import ROW, _full_kv, _shard
    from ringflow.integrations.vllm.kv_prefetch import DcpGroup, KVLayout, KVPrefetcher, KVSource
    from ringflow.kernels import dcp_all_gather, dcp_local_capacity

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    lane = dist.new_group(list(range(world)))       # the gather lane's own communicator
    batch, context, layers = 3, 5000 + 7, 4         # not divisible by the group size
    fulls = [_full_kv(batch, context, seed, device) for seed in (1, 2)]
    shards = [_shard(f, batch, context, rank, world) for f in fulls]
    lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    rows = batch * context

    # the kernel alone, on a side stream, then replayed from a graph
    local = dcp_local_capacity(rows, batch, world)
    slot = torch.full((rows + world * local, ROW), float("nan"), dtype=torch.bfloat16,
                      device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dcp_all_gather(shards[0][0], shards[0][1], lens, slot[:rows],
                       slot[rows:].view(world, local, ROW), lane)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(slot[:rows], fulls[0]), f"rank {rank}: eager all-gather"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dcp_all_gather(shards[1][0], shards[1][1], lens, slot[:rows],
                       slot[rows:].view(world, local, ROW), lane)
    slot.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(slot[:rows], fulls[1]), f"rank {rank}: captured all-gather"

    # the prefetcher: layer l reads cache l % 2, one layer ahead, eager then captured
    layout = KVLayout("rows", (ROW,), torch.bfloat16, 64)
    pf = KVPrefetcher(layout, rows, max_requests=batch, depth=1, workspace_bytes=1 << 34,
                      device=device, dcp=DcpGroup(lane, world, rank), poison=True, name="dcp")
    pf.plan(layers)
    pf.gather_hook = lambda: torch.cuda._sleep(200_000)
    seen = torch.empty(layers, rows, ROW, dtype=torch.bfloat16, device=device)

    def source(layer):
        cache, table = shards[layer % 2]
        return KVSource(cache, table, lens, rows)

    def forward():
        for layer in range(layers):
            pf.begin(layer, source)
            seen[layer].copy_(pf.gathered(layer)[:rows])
            pf.end(layer)

    forward()
    torch.cuda.synchronize()
    for layer in range(layers):
        assert torch.equal(seen[layer], fulls[layer % 2]), f"rank {rank}: eager layer {layer}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        seen.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(seen[layer], fulls[layer % 2]), f"rank {rank}: replay, {layer}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dcp_all_gather_over_nccl_across_gpus(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs of one host (device kinds nvidia-h200-x{world}); this "
                    f"machine has {torch.cuda.device_count()}")
    from ringflow.testing import spawn_group
    spawn_group(world, _rank, backend="nccl", rendezvous=str(tmp_path / "rdzv"))
