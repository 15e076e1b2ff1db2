"""``ringflow tune``: measure the depths a profile's budget allows and keep the fastest."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from ringflow.bench.scenarios import run_profile
from ringflow.errors import DeviceError
from ringflow.orchestrator.profile import Profile
from ringflow.units import MIB


def tune(profile: Profile, *, out: Path, replays: int, max_depth: int = 3) -> int:
    """Measure depths 0..k that fit the budget (k <= ``max_depth``); write the fastest into a
    copy of the profile, with the table measured as a comment."""
    if not torch.cuda.is_available():
        raise DeviceError("ringflow tune measures on a GPU and no CUDA device was found; run it on a "
                          "GPU machine")
    fitting = min(int(profile.workspace_bytes // profile.slot.nbytes) - 1, max_depth)
    rows = []
    for depth in range(0, fitting + 1):
        result = run_profile(f"depth {depth}", profile.replace(depth=depth), replays=replays)
        rows.append((depth, result.ms["captured"], result.ms["sync"], result.pool_bytes))
    best = min(rows, key=lambda r: r[1])
    lines = [f"# tuned by `ringflow tune` on {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}: depth {best[0]} was fastest", "#   depth  captured ms  sync ms"
             "  pool MiB"]
    lines += [f"#   {d:>5}  {c:>11.3f}  {s:>7.3f}  {p / MIB:>8.1f}" for d, c, s, p in rows]
    body = yaml.safe_dump(profile.replace(depth=best[0]).to_mapping(), sort_keys=False)
    out.write_text("\n".join(lines) + "\n" + body)
    print("\n".join(line[2:] for line in lines))
    print(f"wrote {out}")
    return 0
