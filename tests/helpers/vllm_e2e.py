"""End-to-end vLLM (CPU build) runs for the plugin tests, in a process of their own.

    python tests/helpers/vllm_e2e.py CASES.json RESULTS.json

CASES.json is a list of {"name", "model": "llama" | "dsv2", "env": {...}, "additional_config":
{...} | null, "eager": bool}. For each case it builds the tiny model (random, well-scaled
weights written here: no download), starts vLLM, generates greedily from three prompts of
different lengths with top-5 logprobs, and records the tokens, logprobs, ringflow's log lines
and lifecycle, or the error that stopped vLLM.
"""

import collections
import contextlib
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from ringflow.testing.tiny_models import write_model

PROMPTS = [[1, 17, 42, 99, 123, 7, 300, 512], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [1, 250, 3]]


LONG_PROMPT = [1 + (i * 37) % 997 for i in range(70)]  # longer than a prefill chunk of 32
#: MLA context runs: a first request caches a 130-token prefix; then two requests share 128 and
#: 64 of its tokens (prefix-cache hits: their prefill attends over cached context)
CONTEXT_PREFIX = [1 + (i * 37) % 997 for i in range(130)]
CONTEXT_ROUNDS = [[CONTEXT_PREFIX + [5, 6, 7]],
                  [CONTEXT_PREFIX + [8, 9, 10, 11], CONTEXT_PREFIX[:70] + [3, 4]]]


def context_engine(case: dict) -> None:
    """A case's ``context`` options, in this process: vLLM-CPU turns prefix caching and chunked
    prefill off for MLA unless the CPU has AMX, although CPU_MLA's context loop
    (``gather_mla_context_cache_cpu``) runs without it; ``prefix_caching`` turns them back on,
    ``workspace_rows`` shrinks the context workspace so a context spans several chunks,
    ``chunk`` sets max_num_batched_tokens (chunked prefill), ``corrupt`` adds 1 to every
    prefetched slot (the attention must read it: the output changes), ``slow`` (GPU) delays
    each fill by that many clock cycles (a read that skips its wait sees the slot's poison)."""
    from vllm.model_executor.layers.attention import mla_attention
    builder = mla_attention.MLACommonMetadataBuilder
    original_size = _CONTEXT_CHUNK.setdefault(
        "size", builder.__dict__["determine_chunked_prefill_workspace_size"])
    builder.determine_chunked_prefill_workspace_size = original_size
    options = case.get("context")
    _CONTEXT_CHUNK["on"] = bool(options)
    if not options:
        return
    rows = options.get("workspace_rows")
    if rows:
        builder.determine_chunked_prefill_workspace_size = staticmethod(lambda config: rows)
    import torch
    if not torch.cuda.is_available():
        from vllm.platforms import cpu
        original = cpu.CpuPlatform.check_and_update_config.__func__
        if not getattr(original, "_context_case", False):
            def check_and_update_config(cls, vllm_config):
                original(cls, vllm_config)
                if not _CONTEXT_CHUNK.get("on"):
                    return
                vllm_config.cache_config.enable_prefix_caching = True
                chunk = _CONTEXT_CHUNK.get("chunk")
                if chunk:
                    vllm_config.scheduler_config.enable_chunked_prefill = True
                    vllm_config.scheduler_config.max_num_batched_tokens = chunk
            check_and_update_config._context_case = True
            cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    _CONTEXT_CHUNK["chunk"] = options.get("chunk")
    from ringflow.integrations.vllm import context_ring
    fill = getattr(context_ring.ContextModel.fill, "_original", context_ring.ContextModel.fill)
    if options.get("corrupt") or options.get("slow"):
        def changed(self, layer, chunk, slot):
            if options.get("slow"):  # on the gather stream: a read that does not wait sees poison
                torch.cuda._sleep(int(options["slow"]))
            fill(self, layer, chunk, slot)
            if options.get("corrupt"):
                slot.add_(1.0)
        changed._original = fill
        context_ring.ContextModel.fill = changed
    else:
        context_ring.ContextModel.fill = fill


_CONTEXT_CHUNK: dict = {}


def context_stats(model) -> dict:
    """What a model's context-chunk ring did."""
    ring = model.ring
    return {"layers": len(model.layers), "steps": ring.steps, "consumed": ring.consumed,
            "abandoned": dict(ring.abandoned), "checked": model.checked,
            "mismatches": list(model.mismatches), "reserved_bytes": model.reserved_bytes,
            "dcp_size": model.dcp_size, "transport": model.transport,
            "short_steps": model.short_steps,
            "plans": sorted((s.executor.dag.meta["layers"], s.executor.dag.meta["chunks"])
                            for s in ring._steppers.values())}


def kv_stats(model) -> dict:
    """What a model's full-KV lanes did: steps, verification, bytes."""
    lanes = model.lanes
    captured = [lane.read_captured_verification() for lane in lanes]
    return {"layers": len(model.names), "reserved_bytes": model.reserved_bytes,
            "captured_checked": sum(v.captured_checked for v in captured),
            "captured_mismatches": sum(v.captured_mismatches for v in captured),
            "layout": model.layout.kind, "steps": sum(lane.steps for lane in lanes),
            "skipped_steps": sum(lane.skipped_steps for lane in lanes),
            "checked": sum(lane.verification.checked for lane in lanes),
            "mismatches": [m for lane in lanes for m in lane.verification.mismatches],
            "attention_checked": model.attention_checked,
            "attention_max_error": model.attention_max_error,
            "retired": sum(lane.retired for lane in lanes),
            "depth": lanes[0].pool.depth,
            "dcp": lanes[0].dag.meta.get("dcp") if lanes[0].dag is not None else None}


def worker_forwards(worker=None) -> int | None:
    """Forwards this worker's weight streamer ran (None: it has none)."""
    from ringflow.integrations.vllm.state import STATE
    streamer = STATE.latest()
    return None if streamer is None else streamer.stepper.forwards


def worker_kv_stats(worker=None) -> list[dict]:
    """kv_stats of every full-KV model of this process (run in each worker under TP > 1)."""
    from ringflow.integrations.vllm import attention
    return [kv_stats(model) for model in attention.models()]


def worker_context_stats(worker=None) -> list[dict]:
    """context_stats of every context-chunk ring of this process (each worker under TP > 1)."""
    from ringflow.integrations.vllm.state import STATE
    return [context_stats(model) for model in STATE.context_models.values()]


def probe_ring_reads(llm, streamer) -> dict[str, float]:
    """Change one host copy at a time (every parameter of the first offloaded layer) and
    record how far the first step's top-5 logprobs move: a parameter whose change moves
    nothing is not read from the ring."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def first_step():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [sorted(o.outputs[0].logprobs[0].items()) for o in outs]

    def moved(a, b):
        return max(abs(x[1].logprob - y[1].logprob) if x[0] == y[0] else float("inf")
                   for sa, sb in zip(a, b) for x, y in zip(sa, sb))

    clean = first_step()
    gen = torch.Generator().manual_seed(1)
    shifts = {}
    for name, host in streamer.host_copies(streamer.offloaded[0]).items():
        saved = host.clone()
        host.copy_(torch.randn(host.shape, generator=gen, dtype=torch.float32).to(host.dtype))
        try:
            shifts[name] = moved(first_step(), clean)
        finally:
            host.copy_(saved)
    shifts["(restored)"] = moved(first_step(), clean)
    return shifts


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


#: vLLM's graph modes on a GPU (vLLM 0.26 names); "eager" is the CPU default too
GPU_MODES = {
    "eager": {"enforce_eager": True},
    "piecewise": {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "full": {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL"}},
    "default": {"enforce_eager": False},  # vLLM 0.26 on an H200: FULL_AND_PIECEWISE
}


def engine_kwargs(case: dict) -> dict:
    """LLM(...) arguments for the case, on this machine's platform."""
    import torch

    if not torch.cuda.is_available():  # vLLM's CPU build
        kwargs = dict(skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.1,
                      max_model_len=256, max_num_seqs=4, seed=0,
                      enforce_eager=case.get("eager", True), kv_cache_memory_bytes=32 << 20)
        if case["model"].startswith("dsv2"):
            kwargs["attention_backend"] = "CPU_MLA"
            # vLLM-CPU 0.32's C++ rotary op is wrong on MLA's strided views: use the torch one
            kwargs["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
        return kwargs
    mode = json.loads(json.dumps(GPU_MODES[case.get("mode", "eager")]))
    kwargs = dict(skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                  seed=0, gpu_memory_utilization=case.get("gpu_memory_utilization", 0.08), **mode)
    if case.get("profile_memory"):  # vLLM sizes the KV cache itself (the memory-credit check)
        return kwargs
    kwargs["kv_cache_memory_bytes"] = 256 << 20  # no profiling: several engines share a GPU
    if case["model"].startswith("dsv2"):
        kwargs["attention_backend"] = "TRITON_MLA"  # runs for any head count
    if not kwargs["enforce_eager"]:
        # one captured size (decode batches pad to it): fewer captures, the same code paths
        kwargs.setdefault("compilation_config", {})["cudagraph_capture_sizes"] = [4]
    return kwargs


def reload_rounds(llm, root: Path, model: str, generate) -> dict:
    """vLLM's in-place reloads, each followed by a generate: checkpoint B from its path, then
    A and B again as weight iterators (``model.load_weights``)."""
    from safetensors.torch import load_file
    a, b = write_model(root, model), write_model(root, model, seed=1)
    out = {}
    llm.collective_rpc("reload_weights", kwargs={"weights_path": b})
    out["path_b"] = generate()
    for name, path in (("iter_a", a), ("iter_b", b)):
        weights = list(load_file(str(Path(path) / "model.safetensors")).items())
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        out[name] = generate()
    return out


def inflight_reloads(llm, root: Path, model: str, max_tokens: int, before: int = 4) -> dict:
    """One request at a time, each still in flight when the weights change: its prefill and
    ``before - 1`` decode steps on checkpoint A, then ``sleep(level=0, mode="keep")``,
    ``reload_weights`` (checkpoint B), ``wake_up(["scheduling"])``, and its decode goes on (in
    FULL modes: replays of vLLM's captured decode graph, no prefill in between). A is loaded
    again before the next request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    a, b = write_model(root, model), write_model(root, model, seed=1)
    engine = llm.llm_engine
    out = {"tokens": [], "top5": [], "before": []}
    for i, prompt in enumerate(PROMPTS[:2]):
        if i:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": a})
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
        engine.add_request(f"inflight-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        last = None
        for _ in range(before):
            for o in engine.step():
                last = o
        assert last is not None and not last.finished, "the request finished before the reload"
        out["before"].append(len(last.outputs[0].token_ids))
        llm.sleep(level=0, mode="keep")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": b})
        llm.wake_up(tags=["scheduling"])
        while engine.has_unfinished_requests():
            for o in engine.step():
                last = o
        done = last.outputs[0]
        out["tokens"].append(list(done.token_ids))
        out["top5"].append(top5(done))
    return out


#: vLLM's calls that move or replace weights other than reload_weights, as a user makes them
LIFECYCLE_CALLS = {
    "sleep_level_1": lambda llm: llm.sleep(level=1),
    "sleep_level_2": lambda llm: llm.sleep(level=2),
    "init_weight_transfer_engine": lambda llm: llm.collective_rpc(
        "init_weight_transfer_engine", kwargs={"init_info": {}}),
    "start_weight_update": lambda llm: llm.collective_rpc("start_weight_update"),
}


def memory_now() -> dict:
    """Device memory (allocated by torch, free on the device) and torch's pinned host memory."""
    import torch
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    host = torch.cuda.host_memory_stats()
    return {"allocated": torch.cuda.memory_allocated(), "free": torch.cuda.mem_get_info()[0],
            "pinned": host.get("allocated_bytes.current", host.get("allocated_bytes", -1))}


def lifecycle_rounds(llm, root: Path, model: str, generate, cycles: int) -> dict:
    """Each call of LIFECYCLE_CALLS (what it raised, or None), sleep(level=0) and its wake-up,
    a generate after them; then
    ``cycles`` rounds of reload B, generate, reload A, generate, with memory read after each
    round (and once before the first)."""
    out = {"calls": {}}
    for name, call in LIFECYCLE_CALLS.items():
        try:
            call(llm)
            out["calls"][name] = None
        except Exception as exc:  # the refusal under test
            out["calls"][name] = f"{type(exc).__name__}: {exc}"
    try:  # level 0 moves no memory: it pauses scheduling, and must work with streaming on
        llm.sleep(level=0)
        llm.wake_up(tags=["scheduling"])
        out["level_0"] = None
    except Exception as exc:
        out["level_0"] = f"{type(exc).__name__}: {exc}"
    out["after_calls"] = generate()
    a, b = write_model(root, model), write_model(root, model, seed=1)
    out["memory"] = [memory_now()]
    for _ in range(cycles):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": b})
        out["last_b"] = generate()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": a})
        out["last_a"] = generate()
        out["memory"].append(memory_now())
    return out


def run_prompts(llm, prompts, max_tokens: int, temperature: float = 0.0) -> tuple[list, list]:
    """Tokens and top-5 logprobs of ``prompts`` (token-id lists), in one batch: greedy, or
    sampled at ``temperature`` with a fixed seed per request (the same logits give the same
    tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    seed = {"seed": 7} if temperature else {}
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                       logprobs=5, **seed), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [top5(o.outputs[0]) for o in outs]


def top5(completion) -> list:
    """A completion's top-5 logprobs, step by step, as sorted [token, logprob] pairs."""
    return [sorted([tok, lp.logprob] for tok, lp in step.items())
            for step in completion.logprobs]


class _InstallOnly(Exception):
    """A case that installs ringflow's hooks and starts no engine."""


def change_surface(key: str):
    """vLLM as a release that renamed surface ``key`` would meet ringflow, installed afresh
    (``compat.uninstall``, then ``install``): a function or method keeps working for vLLM but
    names its parameters differently (``__signature__``), what ringflow only reads is gone from
    its module under its old name. Returns the function that puts vLLM and the hooks back."""
    import importlib
    import inspect

    from ringflow.integrations.vllm import compat, surfaces
    from ringflow.integrations.vllm.state import STATE
    import vllm.v1.worker.cpu_worker  # noqa: F401 - vLLM's own modules hold their names first

    surface = surfaces.by_key()[key]
    module = importlib.import_module(surface.module)
    *outer, name = surface.path.split(".")
    owner = module
    for part in outer:
        owner = getattr(owner, part)
    held = vars(owner)[name] if name in vars(owner) else None
    compat.uninstall(STATE)
    if surface.kind == "read":
        setattr(owner, f"{name}_renamed", getattr(owner, name))
        delattr(owner, name)

        def restore():
            setattr(owner, name, getattr(owner, f"{name}_renamed"))
            delattr(owner, f"{name}_renamed")
    else:
        original = getattr(owner, name)

        def renamed(*args, **kwargs):
            return original(*args, **kwargs)

        signature = inspect.signature(original)
        renamed.__signature__ = signature.replace(parameters=[
            p.replace(name=f"renamed_{p.name}") for p in signature.parameters.values()])
        setattr(owner, name, renamed)

        def restore():
            if held is None:
                delattr(owner, name)
            else:
                setattr(owner, name, held)

    compat.install(STATE)

    def put_back():
        compat.uninstall(STATE)
        restore()
        compat.install(STATE)

    return put_back


@contextlib.contextmanager
def counting_ringflow_calls():
    """Counts, per function, the Python calls into ringflow's code in this thread (an
    in-process engine runs its steps here) while the block runs."""
    import ringflow
    import ringflow.graphs
    import ringflow.integrations
    import ringflow.kernels
    import ringflow.orchestrator
    roots = tuple(str(Path(m.__file__).parent) + os.sep for m in (
        ringflow, ringflow.integrations, ringflow.graphs, ringflow.orchestrator, ringflow.kernels))
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def run_case(case: dict, root: Path, lines: _Lines) -> dict:
    from vllm import LLM

    from ringflow.integrations.vllm import attention
    from ringflow.integrations.vllm.state import STATE

    context_engine(case)
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    first_line, first_event = len(lines.lines), len(STATE.lifecycle)
    put_back = change_surface(case["surface"]) if case.get("surface") else None
    earlier = {id(m) for m in attention.models()}  # an earlier case's engine may linger
    earlier |= {id(m) for m in STATE.context_models.values()}
    earlier |= {id(m) for m in list(STATE.expert_lanes)}
    kwargs = engine_kwargs(case)
    engine = json.loads(json.dumps(case.get("engine", {})))
    spec = engine.get("speculative_config")
    if spec and spec.get("model") == "DRAFT":  # the same tiny model drafts for itself
        spec["model"] = write_model(root, case["model"])
    if "cpu_offload_params" in engine:  # a set in vLLM's EngineArgs, a list in JSON
        engine["cpu_offload_params"] = set(engine["cpu_offload_params"])
    kwargs.update(engine)
    if case.get("additional_config") is not None:
        kwargs["additional_config"] = case["additional_config"]
    result = {"name": case["name"]}
    started = time.perf_counter()
    llm = None
    try:
        if case.get("install_only"):  # the hooks' installation is the case: no engine
            raise _InstallOnly
        if case.get("dummy"):
            kwargs["load_format"] = "dummy"
        llm = LLM(model=write_model(root, case["model"], not case.get("dummy"),
                                    case.get("seed", 0)), **kwargs)
        result["startup_s"] = round(time.perf_counter() - started, 1)
        expert_lanes = [lane for model, lane in list(STATE.expert_lanes.items())
                        if id(model) not in earlier]
        if case.get("shift_host_experts"):  # the lane must read the host copies: move them
            for lane in expert_lanes:  # every layer's, held ones too, and nothing kept
                for layer in lane.position:
                    for host in lane.store(layer).values():
                        host.mul_(case["shift_host_experts"])
                lane.forget()
        prompts = PROMPTS + ([LONG_PROMPT] if case.get("long_prompt") else [])

        temperature = case.get("temperature", 0.0)

        def generate():
            if case.get("serial"):  # one request at a time (FIELD_NOTES: batched greedy
                # outputs of two GPU engines differ); "reverse": the last prompt first, the
                # outputs given back in the prompts' order (what ran before a request)
                order = list(range(len(prompts)))[::-1 if case.get("reverse") else 1]
                runs = {i: run_prompts(llm, [prompts[i]], case.get("max_tokens", 8),
                                       temperature) for i in order}
                return ([runs[i][0][0] for i in sorted(runs)],
                        [runs[i][1][0] for i in sorted(runs)])
            return run_prompts(llm, prompts, case.get("max_tokens", 8), temperature)
        if case.get("inflight"):  # the weights change under a request in flight
            result["inflight"] = inflight_reloads(llm, root, case["model"],
                                                  case.get("max_tokens", 8))
            result["tokens"], result["top5"] = [], []
        elif case.get("context"):  # two rounds: the second hits the first's cached prefix
            def context_round(r):
                return ([run_prompts(llm, [p], case.get("max_tokens", 8)) for p in r]
                        if case.get("serial") else [run_prompts(llm, r, case.get("max_tokens", 8))])
            rounds = [context_round(CONTEXT_ROUNDS[0])]
            with counting_ringflow_calls() as calls:  # the prefix-hit round: its steps
                rounds.append(context_round(CONTEXT_ROUNDS[1]))
            result["ringflow_calls"] = dict(calls)
            result["tokens"] = [t for r in rounds for got in r for t in got[0]]
            result["top5"] = [t for r in rounds for got in r for t in got[1]]
        else:
            result["tokens"], result["top5"] = generate()
        if case.get("reload"):  # checkpoint B by path, A by iterator, B by iterator
            result["reloads"] = reload_rounds(llm, root, case["model"], generate)
        if case.get("verbs"):  # the other weight verbs, then that many reload cycles
            result["verbs"] = lifecycle_rounds(llm, root, case["model"], generate,
                                               case["verbs"])
        if case.get("repeat"):  # the same engine again: identical, poison and all
            result["repeat_same"] = generate() == (result["tokens"], result["top5"])
        if expert_lanes:
            result["experts"] = [row for lane in expert_lanes for row in lane.report()]
        import torch
        # the CPU GEMMs' sums depend on the threads they split over: a gap between two
        # engines of one process that should agree names these first
        result["threads"] = [torch.get_num_threads(), len(os.sched_getaffinity(0))]
        config = llm.llm_engine.vllm_config
        result["kv_blocks"] = config.cache_config.num_gpu_blocks
        result["kv_block_size"] = config.cache_config.block_size
        result["cudagraph_mode"] = str(getattr(config.compilation_config.cudagraph_mode, "name",
                                               config.compilation_config.cudagraph_mode))
        streamer = STATE.latest() if len(STATE.lifecycle) > first_event else None
        if case.get("probe") and streamer is not None:
            result["probe"] = probe_ring_reads(llm, streamer)
        result["forwards"] = [streamer.stepper.forwards] if streamer is not None else []
        if kwargs.get("tensor_parallel_size", 1) > 1:  # the models live in the workers
            result["kv"] = [s for per_worker in llm.collective_rpc(worker_kv_stats)
                            for s in per_worker]
            result["forwards"] = llm.collective_rpc(worker_forwards)
            result["context"] = [s for per_worker in llm.collective_rpc(worker_context_stats)
                                 for s in per_worker]
        else:
            result["kv"] = [kv_stats(model) for model in attention.models()
                            if id(model) not in earlier]
            result["context"] = [context_stats(model)
                                 for model in STATE.context_models.values()
                                 if id(model) not in earlier]
    except _InstallOnly:
        pass
    except Exception as exc:  # a profile error must stop vLLM: record what it said
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        del llm
        gc.collect()
        if put_back is not None:
            put_back()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    result["lifecycle"] = STATE.lifecycle[first_event:]
    result["log"] = lines.lines[first_line:]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from helpers import mutants
    mutants.apply_from_env()  # RINGFLOW_MUTANT: an executor bug the GPU tests must catch
    cases = json.loads(Path(sys.argv[1]).read_text())
    root = Path(sys.argv[2]).parent / "models"
    lines = _Lines()
    logging.getLogger("ringflow").addHandler(lines)
    logging.getLogger("ringflow").setLevel(logging.INFO)
    results = []
    for case in cases:
        results.append(run_case(case, root, lines))
        print(json.dumps({k: results[-1].get(k) for k in ("name", "seconds", "error")}),
              file=sys.stderr, flush=True)
    Path(sys.argv[2]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
