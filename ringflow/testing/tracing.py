"""TracingWorkload: gathers that write a value naming what they wrote, computes that record
what they read, so a test can say whether every read saw exactly the write the plan intended.

Everything happens on the device without a host sync, so it also works inside a CUDA graph and
across back-to-back forwards; :meth:`TracingWorkload.check` reads it back afterwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import torch

from ringflow.errors import ConfigError

_FORWARD_STRIDE = 4096   # tag = sign * (1 + forward * 4096 + layer * 16 + lane + bucket * 2^20)
_FORWARDS = 256          # forward numbers wrap here: every tag stays exact in float32
_BUCKET_STRIDE = 1 << 20


class TracingWorkload:
    """Gathers write a tag; computes record the min and max of what they read.

    Tags live in a device tensor refreshed by :meth:`new_forward`, so a captured graph's
    gathers write the *current* forward's tags at every replay, and the reads of the last
    ``history`` forwards are kept on the device (archived by :meth:`new_forward` on the current
    stream), so forwards can run back to back without a host sync and all be checked after.

    Args:
        lanes: lane names, in plan order.
        layers: layers per forward.
        slot_shape: shape of one slot (small: the values are what matter).
        device: where slots live.
        gathered: layers that gather (None: all); others read resident data tagged negative.
        bucket: 0..7, added to every tag, so graphs of different buckets write different values.
        history: forwards whose reads :meth:`check` covers.
        static: lanes whose sources never change (streamed weights; cross-forward lanes): their
            tags name the layer but not the forward, as a weight's bytes do.
    """

    def __init__(self, lanes: Sequence[str], layers: int, slot_shape: Sequence[int] = (4,),
                 device: torch.device | str = "cpu", gathered: Iterable[int] | None = None,
                 dtype: torch.dtype = torch.float32, bucket: int = 0, history: int = 8,
                 static: Iterable[str] = ()) -> None:
        if not 0 <= bucket < 8:
            raise ConfigError(f"bucket must be in 0..7 (tags stay exact in float32), got "
                                f"{bucket}; number the buckets 0..7")
        self.lanes = list(lanes)
        self.layers = layers
        self.device = torch.device(device)
        self.gathered = set(range(layers)) if gathered is None else set(gathered)
        self.dtype = dtype
        self.bucket = bucket
        self.epoch = 0
        n = (len(self.lanes), layers)
        self._sign = torch.tensor([[1.0 if layer in self.gathered else -1.0
                                    for layer in range(layers)] for _ in self.lanes],
                                  dtype=torch.float64, device=self.device)
        base = [[1 + layer * 16 + i + bucket * _BUCKET_STRIDE for layer in range(layers)]
                for i in range(len(self.lanes))]
        self._base = torch.tensor(base, dtype=torch.float64, device=self.device) * self._sign
        self.static = set(static)
        moving = [[0.0 if lane in self.static else 1.0] for lane in self.lanes]
        self._sign = self._sign * torch.tensor(moving, dtype=torch.float64, device=self.device)
        self._tags = torch.empty(n, dtype=dtype, device=self.device)   # this forward's tags
        self.seen_min = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self.seen_max = torch.full(n, float("nan"), dtype=torch.float64, device=self.device)
        self._history: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque(maxlen=history)
        self.resident = torch.empty(tuple(slot_shape), dtype=dtype, device=self.device)
        self._set_tags()

    def tag(self, layer: int, lane: str, epoch: int | None = None) -> float:
        """The value the plan intends layer ``layer`` of ``lane`` to read (exact in fp32)."""
        sign = 1 if layer in self.gathered else -1
        epoch = 0 if lane in self.static else self.epoch if epoch is None else epoch
        return float(sign * (1 + epoch * _FORWARD_STRIDE + layer * 16 + self.lanes.index(lane)
                             + self.bucket * _BUCKET_STRIDE))

    def _set_tags(self) -> None:  # on the current stream: ordered before the next forward
        self._tags.copy_(self._base + self._sign * (self.epoch * _FORWARD_STRIDE))

    def new_forward(self) -> None:
        """Archive this forward's reads, then make the next forward write new values (all on
        the current stream, no host sync); the next forward's reads start as NaN."""
        self._history.append((self.epoch, self.seen_min.clone(), self.seen_max.clone()))
        self.epoch = (self.epoch + 1) % _FORWARDS
        self.seen_min.fill_(float("nan"))
        self.seen_max.fill_(float("nan"))
        self._set_tags()

    def gather(self, layer: int, lane: str, out: torch.Tensor) -> None:
        out.copy_(self._tags[self.lanes.index(lane), layer])  # read at run (and replay) time

    def compute(self, layer: int, lane: str, slot: torch.Tensor | None) -> None:
        i = self.lanes.index(lane)
        if slot is None:
            slot = self.resident
            slot.copy_(self._tags[i, layer])
        flat = slot.reshape(-1).to(torch.float64)
        self.seen_min[i, layer].copy_(flat.amin())
        self.seen_max[i, layer].copy_(flat.amax())

    def expected(self, epoch: int | None = None) -> torch.Tensor:
        return torch.tensor([[self.tag(layer, lane, epoch) for layer in range(self.layers)]
                             for lane in self.lanes], dtype=torch.float64)

    def mismatches(self, *, all_forwards: bool = False) -> list[tuple]:
        """``(lane, layer, expected, seen_min, seen_max)`` for every read of the current forward
        that saw another write; ``all_forwards`` also checks the archived ones (each entry then
        starts with the forward's number)."""
        forwards = [(self.epoch, self.seen_min, self.seen_max)]
        if all_forwards:
            forwards = [(e, lo, hi) for e, lo, hi in self._history
                        if not torch.isnan(lo).all()] + forwards
        bad = []
        for epoch, lo, hi in forwards:
            want, lo, hi = self.expected(epoch), lo.cpu(), hi.cpu()
            for i, lane in enumerate(self.lanes):
                for layer in range(self.layers):
                    w, a, b = float(want[i, layer]), float(lo[i, layer]), float(hi[i, layer])
                    if not (a == w and b == w):
                        bad.append(((epoch,) if all_forwards else ()) + (lane, layer, w, a, b))
        return bad

    def check(self, *, all_forwards: bool = False) -> None:
        """Raise AssertionError listing the reads that did not see their intended write."""
        bad = self.mismatches(all_forwards=all_forwards)
        assert not bad, f"{len(bad)} read(s) saw the wrong data, e.g. {bad[:3]}"


