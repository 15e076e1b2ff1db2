"""Adversarial schedules, mutated plans and fuzzed input: ringflow never lets a read see the
wrong write, never lets a broken plan through, and answers bad input with a typed error."""

import dataclasses
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringflow import (Dag, HazardError, NodeKind, Planner, PlanError, Profile, ProfileError,
                      RingflowError, SlotPool, check_hazards)
from ringflow.orchestrator.budget import PoolLayout
from ringflow.orchestrator.simulate import simulate

PLANS = int(os.environ.get("RINGFLOW_PLANS", "10000"))


@st.composite
def plans(draw):
    layers = draw(st.integers(1, 20))
    lanes = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    pools = [PoolLayout.fit(lane, 64, draw(st.integers(0, 4)), 64 * 5) for lane in lanes]
    gathered = draw(st.one_of(st.none(), st.sets(st.integers(0, layers - 1))))
    candidates = sorted(set(range(layers)) if gathered is None else gathered)
    ineligible = draw(st.sets(st.sampled_from(candidates))) if candidates else set()
    cross = draw(st.lists(st.sampled_from(lanes), unique=True))
    synchronous = draw(st.booleans()) if not cross else False
    return Planner(layers, pools, gathered=gathered, ineligible=ineligible, cross_forward=cross,
                   synchronous=synchronous).plan()


FORWARDS = 4


@st.composite
def boundaries(draw, dag):
    """What a host does between forwards: reclaim the ring (resize, KV-cache rebind, executor
    closed), or abandon a forward midway."""
    resets = draw(st.sets(st.integers(1, FORWARDS - 1)))
    abandon = draw(st.dictionaries(st.integers(0, FORWARDS - 2),
                                   st.integers(0, len(dag.nodes) - 1), max_size=2))
    return resets, abandon


@settings(max_examples=PLANS, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), plans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_every_read_sees_the_write_the_plan_intends_in_any_legal_interleaving(data, dag,
                                                                               linearize, seed):
    """Several forwards back to back; between them the ring may be reclaimed or a forward
    abandoned midway, and a plan that carries leases across the boundary primes again."""
    resets, abandon = data.draw(boundaries(dag))
    # linearize: every node on one stream in issue order (the SyncExecutor's path; the seed
    # has no choice to make); otherwise the plan's streams in the interleaving the seed picks
    result = simulate(dag, forwards=FORWARDS, seed=seed, linearize=linearize, resets=resets,
                      abandon=abandon)
    issued = {f: dag.nodes[: abandon[f]] if f in abandon else dag.nodes for f in range(FORWARDS)}
    if linearize:
        primed = set(result.primes)
        assert result.order == [(f, n.id) for f in range(FORWARDS)
                                for n in ((dag.prime if f in primed else ()) + issued[f])]
    assert not result.wrong_reads, result.wrong_reads[:3]
    assert len(result.reads) == sum(1 for f in range(FORWARDS) for n in issued[f]
                                    if n.kind is NodeKind.COMPUTE and n.slot is not None)
    if dag.prime:  # the first forward, and every one after a reclaim, primes; no other does
        after = {f + 1 for f in abandon} | set(resets) | {0}
        assert result.primes == sorted(f for f in after if f < FORWARDS)


def _rebuild(dag, nodes=None, prime=None):
    renumber = lambda seq: tuple(dataclasses.replace(n, id=i) for i, n in enumerate(seq))
    return Dag(dag.name, dag.layers, dag.pools,
               renumber(dag.nodes if nodes is None else nodes),
               prime=renumber(dag.prime if prime is None else prime))


def mutants(dag):
    """Every single-edge mutation: drop a wait or a record, or point it at another event, in
    the forward or in its prime (the boundary's edges)."""
    records = [n for n in (*dag.nodes, *dag.prime) if n.kind is NodeKind.RECORD]
    events = sorted({(n.event, n.role) for n in records})
    for part in ("nodes", "prime"):
        seq = getattr(dag, part)
        for node in seq:
            if node.kind not in (NodeKind.WAIT, NodeKind.RECORD):
                continue
            where = "prime " if part == "prime" else ""
            yield (f"drop {where}{node.label}",
                   _rebuild(dag, **{part: [n for n in seq if n.id != node.id]}))
            for event, role in events:
                if event != node.event:
                    changed = dataclasses.replace(node, event=event, role=role)
                    yield (f"re-point {where}{node.label} to {event}",
                           _rebuild(dag, **{part: [changed if n.id == node.id else n
                                                   for n in seq]}))


def killed(mutant):
    try:
        check_hazards(mutant)
    except HazardError:
        return True
    return any(simulate(mutant, forwards=3, seed=s).wrong_reads for s in range(12))


MUTATION_PLANS = [
    dict(layers=5, depths=[1]),
    dict(layers=7, depths=[2]),
    dict(layers=6, depths=[1], ineligible=[2, 3]),
    dict(layers=9, depths=[1], gathered=[2, 3, 6, 7]),
    dict(layers=6, depths=[1, 2]),
    dict(layers=4, depths=[0, 1]),
    dict(layers=8, depths=[3], ineligible=[4], gathered=[0, 1, 3, 4, 5, 7]),
    # the forward boundary: carried leases, tail gathers and the prime
    dict(layers=6, depths=[1], cross=True),
    dict(layers=7, depths=[2], cross=True),
    dict(layers=9, depths=[0], gathered=[2, 3, 6, 7], cross=True),
    dict(layers=8, depths=[1, 1], gathered=[1, 2, 5, 6], cross=True),
]


def test_every_single_edge_mutation_is_caught():
    total = caught = 0
    survivors = []
    for spec in MUTATION_PLANS:
        pools = [PoolLayout.fit(f"l{i}", 64, d, 64 * 8) for i, d in enumerate(spec["depths"])]
        dag = Planner(spec["layers"], pools, gathered=spec.get("gathered"),
                      ineligible=spec.get("ineligible", ()),
                      cross_forward=[p.lane for p in pools] if spec.get("cross") else ()).plan()
        assert bool(dag.prime) == bool(spec.get("cross"))
        for name, mutant in mutants(dag):
            total += 1
            if killed(mutant):
                caught += 1
            else:
                survivors.append((spec, name))
    print(f"mutation kill rate: {caught}/{total} = {100 * caught / total:.1f}%")
    assert total > 500 and not survivors, survivors[:5]


# -- fuzzing the inputs ---------------------------------------------------------------------

KEYS = ["name", "layers", "depth", "workspace_mib", "slot", "lanes", "gathered_layers",
        "ineligible", "capture", "gather_priority", "kv_token_bytes", "workload", "offload",
        "deph", "extra"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(
        ["shape", "dtype", "layers", "depth", "workspace_mib", "every", "last", "gather",
         "queries", "zzz"]), inner, max_size=4)), max_leaves=12)
good = {"layers": 4, "depth": 1, "workspace_mib": 1, "slot": {"shape": [8, 8], "dtype": "float32"}}


def _holds(doc, field):
    """Whether ``doc`` has ``field`` (dotted: ``slot.shape`` is ``shape`` in ``doc["slot"]``)."""
    *parents, name = field.split(".")
    for parent in parents:
        doc = doc.get(parent) if isinstance(doc, dict) else None
    return isinstance(doc, dict) and name in doc


@settings(max_examples=1500, deadline=2000)
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=6), st.booleans())
def test_fuzzed_profiles_get_only_typed_errors_that_name_the_field(doc, start_good):
    if start_good:
        doc = {**good, **doc}
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        profile = Profile.from_yaml_text(text, source="fuzz.yaml")
    except ProfileError as exc:
        assert exc.field is not None, str(exc)
        named = f"fuzz.yaml: field '{exc.field}': "
        assert str(exc).startswith(named), str(exc)
        # the field named is one the document holds, unless the error says it is missing
        missing = str(exc).startswith(named + "is missing")
        assert _holds(doc, exc.field) is not missing, str(exc)
        return
    if profile.layers is not None:
        try:
            Planner.from_profile(profile).plan()
        except RingflowError:
            pass


@settings(max_examples=300, deadline=2000)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_a_profile_error_or_a_profile(data):
    try:
        Profile.from_yaml_text(data, source="bytes.yaml")
    except ProfileError:
        pass


@settings(max_examples=400, deadline=2000)
@given(layers=scalars, depth=scalars, budget=scalars, shape=st.lists(scalars, max_size=3),
       gathered=st.one_of(st.none(), st.lists(scalars, max_size=4)),
       ineligible=st.lists(scalars, max_size=4))
def test_the_public_api_answers_bad_arguments_with_typed_errors(layers, depth, budget, shape,
                                                               gathered, ineligible):
    try:  # on the meta device: the arithmetic and validation run, nothing is allocated
        pool = SlotPool("kv", shape, "float32", depth=depth, workspace_bytes=budget,
                        device="meta")
    except RingflowError:
        pool = None
    try:
        Planner(layers, [pool.layout] if pool else [PoolLayout.fit("kv", 4, 1, 64)],
                gathered=gathered, ineligible=ineligible).plan()
    except RingflowError:
        pass


def test_empty_and_duplicate_layer_sets_are_refused_with_the_field_named():
    with pytest.raises(ProfileError, match="offload.layers': is empty"):
        Profile.from_mapping({"offload": {"layers": [], "workspace_mib": 1}})
    with pytest.raises(ProfileError, match="field 'ineligible': layer 1 is listed twice"):
        Profile.from_mapping({**good, "ineligible": [1, 1]})
    with pytest.raises(PlanError, match="ineligible must hold layer indices"):
        Planner(3, [PoolLayout.fit("kv", 4, 1, 64)], ineligible=[7]).plan()
