"""Hostile configuration input: every key of ``UlaCacheConfig`` and ``SGLangOptions`` through
every route (keyword construction, ``from_dict``, ``from_json``, ``replace``, and the SGLang
plugin's ``validate_sglang_config``) refuses wrong types, out-of-range values, non-finite numbers,
unknown keys and broken JSON with a :class:`ConfigError` that names the key; and sizes that are
legal but do not fit in memory are refused with :class:`CapacityExhausted` naming the pool,
before anything large is allocated."""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time

import pytest

from ulacache.cache import UlaCache
from ulacache.config import (
    MAX_CPU_SLOTS,
    MAX_GPU_SLOTS,
    SGLangOptions,
    UlaCacheConfig,
    validate_sglang_config,
)
from ulacache.errors import CapacityExhausted, ConfigError, UlaCacheError
from ulacache.pblru import POLICIES
from ulacache.space import AddressSpace

# -- the documented ranges -------------------------------------------------------------------
# key -> (lowest legal, highest legal, base keys that make both ends legal)
ULA_INTS = {
    "row_bytes": (1, 1 << 16, {"layout": "tiny"}),
    "n_layers": (1, 4096, {}),
    "layers_per_group": (1, 4096, {"n_layers": 4096}),
    "gpu_slots": (1, MAX_GPU_SLOTS, {}),
    "cpu_slots": (0, MAX_CPU_SLOTS, {}),
    "page_size": (1, 1 << 16, {}),
    "max_requests": (1, 1 << 24, {}),
    "n_buckets": (2, 4096, {}),
}
SGL_INTS = {
    "cpu_ratio": (0, 1024, {}),
    "n_buckets": (2, 4096, {}),
    "buffer_slots": (1, MAX_GPU_SLOTS, {"mode": "tp"}),
}
OPTIONAL_INTS = ("row_bytes", "buffer_slots")  # ``None`` is legal for these
INT_CASES = [(UlaCacheConfig, k, *v) for k, v in ULA_INTS.items()] + \
    [(SGLangOptions, k, *v) for k, v in SGL_INTS.items()]
INT_IDS = [f"{cls.__name__}.{key}" for cls, key, *_ in INT_CASES]

ENUMS = [
    (UlaCacheConfig, "layout", ("fp8", "bf16", "tiny")),
    (UlaCacheConfig, "policy", tuple(POLICIES)),
    (SGLangOptions, "policy", tuple(POLICIES)),
    (SGLangOptions, "mode", ("dp", "tp")),
]
REMOVED_KNOBS = ["fetch_cap", "max_batch", "top_k"]

# Values no integer key accepts, whatever its range (``None`` is legal only for row_bytes).
NOT_INTS = [1.5, 1.0, 100.0, True, False, "100", "1", math.inf, -math.inf, math.nan, [1], {"v": 1},
            1e3, -0.0]
NOT_BOOLS = ["no", "yes", "false", "true", 1, 0, 1.0, 0.0, None, "", math.nan, [True]]
INF_NAN_JSON = ["Infinity", "-Infinity", "NaN"]


def build(cls, route: str, values: dict):
    """Construct ``cls`` from ``values`` through one public route."""
    if route == "kw":
        return cls(**values)
    if route == "dict":
        return cls.from_dict(dict(values))
    if route == "json":
        return cls.from_json(json.dumps(values))  # inf / nan become Infinity / NaN literals
    if route == "json-bytes":
        return cls.from_json(json.dumps(values).encode())
    if route == "replace":
        return cls().replace(**values)
    if route == "sglang":
        assert cls is SGLangOptions
        return validate_sglang_config(json.loads(json.dumps(values)))
    raise AssertionError(route)


def routes(cls) -> list[str]:
    extra = ["sglang"] if cls is SGLangOptions else []
    return ["kw", "dict", "json", "json-bytes", "replace"] + extra


def refused(cls, route: str, values: dict, *names: str) -> ConfigError:
    """Assert the construction raises a ConfigError whose message names every ``names``."""
    with pytest.raises(ConfigError) as info:
        build(cls, route, values)
    err = info.value
    assert isinstance(err, UlaCacheError) and isinstance(err, ValueError)
    for name in names:
        assert name in str(err), f"{name!r} not named in: {err}"
    return err


# -- integer keys ------------------------------------------------------------------------------
@pytest.mark.parametrize(("cls", "key", "lo", "hi", "base"), INT_CASES, ids=INT_IDS)
def test_integer_keys_refuse_non_integers_on_every_route(cls, key, lo, hi, base):
    for route in routes(cls):
        for bad in NOT_INTS:
            if route == "replace" and base:
                continue  # covered by the other routes; replace() starts from the defaults
            err = refused(cls, route, {**base, key: bad}, key)
            if route in ("kw", "dict", "replace") or not (
                    isinstance(bad, float) and not math.isfinite(bad)):
                assert "legal" in str(err), str(err)  # parse errors of Infinity/NaN excepted
        if key not in OPTIONAL_INTS:
            refused(cls, route, {**base, key: None}, key)


@pytest.mark.parametrize(("cls", "key", "lo", "hi", "base"), INT_CASES, ids=INT_IDS)
def test_integer_keys_enforce_the_documented_range(cls, key, lo, hi, base):
    for route in routes(cls):
        if route == "replace" and base:
            continue
        for bad in (lo - 1, hi + 1, -1, -(2**63), 2**63, 2**70):
            if bad in range(lo, hi + 1):
                continue
            err = refused(cls, route, {**base, key: bad}, key)
            assert str(lo) in str(err) or str(hi) in str(err), str(err)  # the bounds are named
        for good in (lo, hi):
            assert getattr(build(cls, route, {**base, key: good}), key) == good


def test_zero_and_negative_sizes_are_refused_where_illegal():
    for key in ("n_layers", "layers_per_group", "gpu_slots", "page_size", "max_requests"):
        for bad in (0, -1, -64):
            refused(UlaCacheConfig, "kw", {key: bad}, key)
            refused(UlaCacheConfig, "json", {key: bad}, key)
    refused(UlaCacheConfig, "kw", {"layout": "tiny", "row_bytes": 0}, "row_bytes")
    refused(UlaCacheConfig, "kw", {"n_buckets": 1}, "n_buckets")
    refused(UlaCacheConfig, "kw", {"cpu_slots": -1}, "cpu_slots")
    refused(SGLangOptions, "sglang", {"cpu_ratio": -1}, "cpu_ratio")
    # zero is legal where documented: no CPU tier, no CPU pool ratio
    assert UlaCacheConfig(cpu_slots=0).unique_capacity == UlaCacheConfig().gpu_slots
    assert SGLangOptions(cpu_ratio=0).host_to_device_ratio == 1


# -- JSON specifics ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
@pytest.mark.parametrize("literal", INF_NAN_JSON)
def test_from_json_refuses_non_finite_literals(cls, literal):
    key = "gpu_slots" if cls is UlaCacheConfig else "cpu_ratio"
    for text in (f'{{"{key}": {literal}}}', f'{{"validate": {literal}}}', literal,
                 f'{{"{key}": [{literal}]}}'):
        with pytest.raises(ConfigError) as info:
            cls.from_json(text)
        assert "JSON" in str(info.value) and literal in str(info.value)
    # the plugin parses with json.loads (which accepts the literals): the values still fail
    if cls is SGLangOptions:
        for key in SGLangOptions.keys():
            with pytest.raises(ConfigError, match=key):
                validate_sglang_config(json.loads(f'{{"{key}": {literal}}}'))


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
@pytest.mark.parametrize("text", ["[1]", "[]", "3", "1.5", '"x"', "true", "false",
                                  '[{"validate": true}]'])
def test_from_json_refuses_non_object_json(cls, text):
    with pytest.raises(ConfigError, match="JSON object"):
        cls.from_json(text)
    with pytest.raises(ConfigError, match="JSON object"):
        cls.from_dict(json.loads(text))


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
@pytest.mark.parametrize("text", ["{", '{"validate": true', "{validate: true}",
                                  "{'validate': true}", '{"validate": true,}',
                                  '{"validate": true} x', '{"validate": True}',
                                  '{"validate": tru}', "\x00", '{"validate": 0x10}',
                                  '{"n_buckets": 08}'])
def test_from_json_refuses_malformed_json(cls, text):
    with pytest.raises(ConfigError, match="not valid JSON"):
        cls.from_json(text)
    with pytest.raises(ConfigError, match="not valid JSON"):
        cls.from_json(text.encode())


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
def test_empty_json_means_defaults(cls):
    for text in (None, "", "  \n", b"", "{}", b"{}"):
        assert cls.from_json(text) == cls()


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
def test_from_dict_refuses_non_mappings_and_non_string_keys(cls):
    for bad in ([("validate", True)], "validate", 3, ("validate",), {1: 2}, {None: 1},
                {("validate",): True}):
        with pytest.raises(ConfigError, match="JSON object"):
            cls.from_dict(bad)
    if cls is SGLangOptions:
        for bad in ('{"mode": "dp"}', [], 0):
            with pytest.raises(ConfigError, match="JSON object"):
                validate_sglang_config(bad)


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
@pytest.mark.parametrize("arg", [123, ["x"], {"validate": True}], ids=["int", "list", "dict"])
def test_from_json_refuses_a_non_text_argument(cls, arg):
    with pytest.raises(ConfigError):
        cls.from_json(arg)


# -- booleans ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
def test_validate_is_a_strict_boolean(cls):
    for route in routes(cls):
        for bad in NOT_BOOLS:
            err = refused(cls, route, {"validate": bad}, "validate")
            if not (isinstance(bad, float) and math.isnan(bad)) or route == "kw":
                assert "true or false" in str(err), str(err)
        for good in (True, False):
            assert build(cls, route, {"validate": good}).validate is good
    assert cls.from_json('{"validate": false}').validate is False
    assert cls.from_json('{"validate": true}').validate is True


def test_validate_defaults():
    assert UlaCacheConfig().validate is True  # library use: checked
    assert SGLangOptions().validate is False  # serving: no host sync per step


# -- enums ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cls", "key", "legal"), ENUMS,
                         ids=[f"{c.__name__}.{k}" for c, k, _ in ENUMS])
def test_enum_keys_name_their_legal_values(cls, key, legal):
    for route in routes(cls):
        for bad in ["int4", "", "FP8", "PBLRU", "DP", "tp", " dp", legal[0].upper() + " ",
                    None, 1, True, 1.5, [legal[0]]]:
            if bad in legal:
                continue
            err = refused(cls, route, {key: bad}, key)
            for value in legal:
                assert repr(value) in str(err), f"legal value {value!r} not named: {err}"
        for good in legal:
            assert getattr(build(cls, route, {key: good}), key) == good


# -- unknown keys --------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
@pytest.mark.parametrize("key", REMOVED_KNOBS + ["gpu_slot", "Validate", "", "_what", "keys"])
def test_unknown_and_removed_keys_are_refused_by_name(cls, key):
    for route in ("dict", "json", "replace") + (("sglang",) if cls is SGLangOptions else ()):
        err = refused(cls, route, {key: 4}, repr(key), "legal keys")
        for legal in cls.keys():
            assert repr(legal) in str(err), f"legal key {legal!r} not listed: {err}"


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
def test_unknown_keyword_is_a_type_error_naming_it(cls):
    """Python construction follows Python's rule for an unknown keyword (a TypeError naming it);
    dict and JSON input get a ConfigError listing the legal keys (above)."""
    with pytest.raises(TypeError, match="fetch_cap"):
        cls(fetch_cap=3)


def test_removed_knobs_are_not_fields():
    for cls in (UlaCacheConfig, SGLangOptions):
        assert not set(REMOVED_KNOBS) & set(cls.keys())


# -- cross-field checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["kw", "dict", "json", "replace"])
def test_row_bytes_only_for_tiny(route):
    for layout in ("fp8", "bf16"):
        refused(UlaCacheConfig, route, {"layout": layout, "row_bytes": 16}, "row_bytes", "tiny")
        assert build(UlaCacheConfig, route, {"layout": layout, "row_bytes": None}).row_bytes \
            is None
    cfg = build(UlaCacheConfig, route, {"layout": "tiny", "row_bytes": 48})
    assert cfg.row_layout.row_bytes == 48
    assert build(UlaCacheConfig, route, {"layout": "tiny"}).row_layout.row_bytes == 16


@pytest.mark.parametrize("route", ["kw", "dict", "json", "replace"])
def test_layers_per_group_must_divide_n_layers(route):
    for n, lpg in ((6, 4), (4, 8), (7, 2), (1, 2), (4095, 4096)):
        refused(UlaCacheConfig, route, {"n_layers": n, "layers_per_group": lpg},
                "layers_per_group", "n_layers")
    for n, lpg in ((8, 4), (4, 4), (78, 2), (4096, 4096)):
        assert build(UlaCacheConfig, route, {"n_layers": n, "layers_per_group": lpg}).n_groups \
            == n // lpg


# -- replace, round trips --------------------------------------------------------------------------
def test_replace_revalidates_and_leaves_the_original_alone():
    base = UlaCacheConfig(layout="tiny", row_bytes=32, n_layers=8, layers_per_group=2)
    for changes, key in [({"gpu_slots": 1.5}, "gpu_slots"), ({"validate": "no"}, "validate"),
                         ({"layout": "fp8"}, "row_bytes"), ({"n_layers": 7}, "layers_per_group"),
                         ({"top_k": 8}, "top_k"), ({"policy": "fifo"}, "policy"),
                         ({"n_buckets": 1}, "n_buckets")]:
        with pytest.raises(ConfigError, match=key):
            base.replace(**changes)
    assert base == UlaCacheConfig(layout="tiny", row_bytes=32, n_layers=8, layers_per_group=2)
    new = base.replace(gpu_slots=64, layout="fp8", row_bytes=None)
    assert (new.gpu_slots, new.layout, new.row_bytes) == (64, "fp8", None)
    assert base.gpu_slots == 1024 and base.row_bytes == 32
    with pytest.raises(ConfigError, match="cpu_ratio"):
        SGLangOptions().replace(cpu_ratio=-1)
    with pytest.raises(AttributeError):
        base.gpu_slots = 3  # frozen: no way around validation


@pytest.mark.parametrize("cls", [UlaCacheConfig, SGLangOptions])
def test_defaults_round_trip(cls):
    d = cls().to_dict()
    assert list(d) == cls.keys()
    assert cls.from_dict(d) == cls()
    assert cls.from_json(json.dumps(d)) == cls()
    assert cls(**d) == cls()
    assert cls().replace() == cls()
    if cls is SGLangOptions:
        assert validate_sglang_config(d) == cls() == validate_sglang_config({})
        assert validate_sglang_config(None) == cls()


def test_non_default_round_trip():
    cfg = UlaCacheConfig(layout="tiny", row_bytes=48, n_layers=12, layers_per_group=4,
                         gpu_slots=MAX_GPU_SLOTS, cpu_slots=MAX_CPU_SLOTS, page_size=1,
                         max_requests=1 << 24, n_buckets=2, policy="lru", validate=False)
    assert UlaCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert UlaCacheConfig.from_json(json.dumps(cfg.to_dict())) == cfg
    opts = SGLangOptions(cpu_ratio=0, n_buckets=4096, policy="lru", validate=True)
    assert validate_sglang_config(json.loads(json.dumps(opts.to_dict()))) == opts


# -- sizes that are legal but do not fit -----------------------------------------------------------
def _vm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def address_space_limit(headroom: int):
    """Cap this process's virtual memory at its current size + ``headroom`` while the block
    runs, so that a regression that allocates first cannot OOM the machine: it fails instead."""
    vm = _vm_bytes()
    if vm is None:
        pytest.skip("needs /proc/self/status (Linux) to bound the test's memory")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm + headroom
    if hard != resource.RLIM_INFINITY:
        if hard <= vm + (64 << 20):
            pytest.skip("the hard address-space limit leaves no room to run this test")
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


PETABYTES = UlaCacheConfig(layout="bf16", gpu_slots=MAX_GPU_SLOTS, n_layers=4096)
HUGE = [
    ("space-gpu", lambda: AddressSpace(PETABYTES, n_logical=1024), "GPU pool"),
    ("space-gpu-grouped", lambda: AddressSpace(PETABYTES.replace(layers_per_group=4096),
                                               n_logical=1024), "GPU pool"),
    ("space-cpu", lambda: AddressSpace(UlaCacheConfig(layout="bf16", gpu_slots=8,
                                                      cpu_slots=MAX_CPU_SLOTS, n_layers=4096),
                                       n_logical=1024), "CPU pool"),
    ("space-mapping", lambda: AddressSpace(UlaCacheConfig(layout="tiny", gpu_slots=8,
                                                          cpu_slots=8, n_layers=1),
                                           n_logical=2**40), "mapping table"),
    ("cache-gpu-big-pages", lambda: UlaCache(PETABYTES.replace(page_size=1 << 16)), "GPU pool"),
]


@pytest.mark.parametrize(("make", "pool"), [h[1:] for h in HUGE], ids=[h[0] for h in HUGE])
def test_huge_sizes_are_refused_before_allocating(make, pool):
    t0 = time.perf_counter()
    with address_space_limit(512 << 20), pytest.raises(CapacityExhausted) as info:
        make()
    assert time.perf_counter() - t0 < 5.0
    msg = str(info.value)
    assert pool in msg and "GiB" in msg, msg
    assert "could not be allocated" not in msg, msg  # refused by the check, not by the allocator


@pytest.mark.parametrize("config", [
    UlaCacheConfig(layout="tiny", gpu_slots=8, cpu_slots=MAX_CPU_SLOTS, n_layers=1),
    PETABYTES,
], ids=["cpu-2**40", "petabytes-page-64"])
def test_huge_request_ledger_is_refused_before_allocating(config):
    with address_space_limit(512 << 20), pytest.raises(CapacityExhausted):
        UlaCache(config)


# -- TP mode keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("route", routes(UlaCacheConfig))
def test_tp_keys_are_checked_together(route):
    refused(UlaCacheConfig, route, {"tp_size": 2}, "'buffer_slots'", ">= 1")
    refused(UlaCacheConfig, route, {"buffer_slots": 8}, "'buffer_slots'", "only for TP")
    refused(UlaCacheConfig, route, {"tp_size": 4, "buffer_slots": 8, "page_size": 6},
            "'tp_size'", "'page_size'")
    for bad in (0, 9, -1):
        refused(UlaCacheConfig, route, {"tp_size": bad, "buffer_slots": 8}, "tp_size")
    refused(UlaCacheConfig, route, {"tp_size": 2, "buffer_slots": -1}, "buffer_slots")
    refused(UlaCacheConfig, route, {"tp_size": 2, "buffer_slots": 8, "shard_indexer": 1},
            "shard_indexer")
    c = build(UlaCacheConfig, route, {"tp_size": 4, "buffer_slots": 8, "gpu_slots": 10,
                                      "cpu_slots": 6})
    assert (c.tp_size, c.buffer_slots, c.shard_indexer) == (4, 8, True)
    assert c.unique_capacity == 64  # 4 ranks x (10 + 6) unique rows
    assert [c.charge(n) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]  # ceil(n / P) per rank


@pytest.mark.parametrize("route", routes(SGLangOptions))
def test_sglang_tp_keys(route):
    """``buffer_slots`` and ``shard_indexer`` are TP-mode keys (refused in DP mode, where
    nothing reads them); ``shard_indexer`` is a strict boolean; ``buffer_slots`` may be null
    (derived at start-up)."""
    refused(SGLangOptions, route, {"buffer_slots": 8}, "'buffer_slots'", "only for mode 'tp'")
    refused(SGLangOptions, route, {"shard_indexer": True}, "'shard_indexer'", "only for mode")
    for bad in NOT_BOOLS:
        refused(SGLangOptions, route, {"mode": "tp", "shard_indexer": bad}, "shard_indexer")
    opts = build(SGLangOptions, route, {"mode": "tp", "buffer_slots": 8, "shard_indexer": True})
    assert (opts.mode, opts.buffer_slots, opts.shard_indexer) == ("tp", 8, True)
    opts = build(SGLangOptions, route, {"mode": "tp", "buffer_slots": None})
    assert (opts.buffer_slots, opts.shard_indexer) == (None, False)
    assert build(SGLangOptions, route, {"shard_indexer": False}).mode == "dp"
