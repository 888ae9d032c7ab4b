"""Hypothesis properties run by ``test_properties.py``, each in a child process
(so that a segfault, an abort or a hang fails the test instead of the suite):
every input through the public API and the command line gives a result or an
``AutomapError``; anything else (a ``PanicException``, a ``TypeError``, a crash)
is a failure, shrunk and printed by hypothesis.

Run one by hand: ``python tests/properties/fuzz_targets.py meshes_specs_layouts``."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import sys
import tempfile
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import automap
from automap.errors import AutomapError

#: Deterministic, bounded, no example database written into the repository.
SETTINGS = settings(max_examples=int(os.environ.get("AUTOMAP_FUZZ_EXAMPLES", 60)),
                    deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# Values at the edges: zero, negatives, huge, non-finite, wrong types.
EDGE_INTS = st.one_of(st.integers(-3, 9), st.sampled_from([2**31, 2**32, 2**62, 2**63, 2**64,
                                                           10**6, -(2**63)]))
EDGE_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([0.0, -1.0, 1e-300, 1e300, 5e-6, 1e10, 2e11, 1e12]))
JUNK = st.one_of(st.none(), st.booleans(), st.text(max_size=4), EDGE_FLOATS,
                 st.lists(st.integers(-2, 3), max_size=3))
SHAPES = st.one_of(st.lists(EDGE_INTS, max_size=5), st.lists(st.integers(1, 16), max_size=4),
                   JUNK)
SPEC_TEXT = st.text(alphabet="RS0123489x", max_size=8)
SMALL_MESH = st.lists(st.integers(1, 4), min_size=1, max_size=3)


def ok_or_typed(fn, *args, **kwargs):
    """Call; an AutomapError is an acceptable answer, any other error fails."""
    try:
        return fn(*args, **kwargs)
    except AutomapError:
        return None


@SETTINGS
@given(shape=st.one_of(SMALL_MESH, SHAPES), alpha=st.one_of(EDGE_FLOATS, JUNK),
       bandwidth=st.one_of(EDGE_FLOATS, JUNK), names=st.one_of(st.none(), JUNK))
def meshes(shape, alpha, bandwidth, names):
    ok_or_typed(automap.DeviceMesh, shape, alpha_s=alpha, bandwidth_bytes_per_s=bandwidth,
                axis_names=names)


@SETTINGS
@given(mesh_shape=SMALL_MESH, specs=st.lists(SPEC_TEXT, min_size=2, max_size=4),
       shape=SHAPES, dtype=st.one_of(EDGE_INTS, JUNK), rank=st.one_of(EDGE_INTS, JUNK),
       coordinate=SHAPES, axes=st.one_of(st.lists(EDGE_INTS, max_size=3), JUNK),
       kind=st.sampled_from(["all_reduce", "all_gather", "broadcast", "scatter", ""]),
       nbytes=st.one_of(EDGE_FLOATS, JUNK), method=st.sampled_from(["optimal", "heuristic", "x"]))
def meshes_specs_layouts(mesh_shape, specs, shape, dtype, rank, coordinate, axes, kind, nbytes,
                         method):
    mesh = automap.DeviceMesh(mesh_shape)
    ok_or_typed(mesh.coordinate, rank)
    ok_or_typed(mesh.rank_at, coordinate)
    ok_or_typed(mesh.axis_groups, axes)
    ok_or_typed(mesh.collective_cost_s, kind, nbytes, axes)
    for text in specs:
        spec = ok_or_typed(automap.ShardingSpec.parse, text)
        if spec is None:
            continue
        ok_or_typed(spec.validate, shape, mesh)
        ok_or_typed(spec.local_shape, shape, mesh)
        ok_or_typed(spec.local_slices, shape, mesh, rank)
        ok_or_typed(spec.shard_count, mesh)
    ok_or_typed(automap.ShardingSpec.from_dims, coordinate)
    ok_or_typed(automap.ShardingSpec.from_dims, [coordinate, axes])
    ok_or_typed(automap.ShardingSpec.replicated, rank)
    ok_or_typed(automap.enumerate_specs, shape, mesh)
    ok_or_typed(automap.layout_path, mesh, specs[0], specs[1], shape, dtype, method=method)
    ok_or_typed(automap.resharding_cost_matrix, mesh, specs[:2], specs[1:], shape, dtype)


def _tiny_model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, (torch.randn(8, 8),), (lambda out: out.pow(2).mean())


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


_TRACED: dict = {}


def _traced():
    if not _TRACED:
        from automap.trace.profiling import profile_traced
        from automap.trace.tracing import trace

        model, inputs, loss = _tiny_model()
        traced = trace(model, inputs, loss_fn=loss)
        _TRACED.update(model=model, inputs=inputs, loss=loss, traced=traced,
                       profile=profile_traced(traced, "adamw"))
    return _TRACED


@SETTINGS
@given(mesh_shape=SMALL_MESH,
       budget=st.one_of(st.none(), st.sampled_from([3000, 3500.5, 5000, 1e5, 1e9]), EDGE_FLOATS,
                        EDGE_INTS, JUNK),
       flops=st.one_of(st.none(), st.sampled_from([1e3, 1e6, 1e9, 1e12, 1e21]), EDGE_FLOATS,
                       JUNK),
       alpha=st.one_of(st.sampled_from([0.0, 1e-6, 1e-5, 60.0]), EDGE_FLOATS),
       bandwidth=st.one_of(st.sampled_from([1e3, 1e9, 2e11, 1e15]), EDGE_FLOATS),
       limit=st.one_of(st.just(10.0), EDGE_FLOATS),
       optimizer=st.sampled_from(["adamw", "sgd", None, "lamb", 3]),
       checkpointing=st.sampled_from(["auto", "off", "only", "no"]))
def planning(mesh_shape, budget, flops, alpha, bandwidth, limit, optimizer, checkpointing):
    from automap.planner.search import plan_traced

    case = _traced()
    mesh = ok_or_typed(automap.DeviceMesh, mesh_shape, alpha_s=alpha,
                       bandwidth_bytes_per_s=bandwidth)
    if mesh is None:
        return
    with _quiet():
        found = ok_or_typed(plan_traced, case["traced"], case["profile"], mesh, budget,
                            flops_per_s=flops, time_limit_s=limit, optimizer=optimizer,
                            checkpointing=checkpointing)
    if found is not None:
        assert math.isfinite(found.predicted_step_s)
        found.explain()


def _plan_record() -> dict:
    case = _traced()
    if "record" not in case:
        from automap.planner.search import plan_traced

        with _quiet():
            found = plan_traced(case["traced"], case["profile"], automap.DeviceMesh((2,)),
                                4000, flops_per_s=1e6)
        case["record"] = found.to_dict()
    return case["record"]


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2, 2**64), EDGE_FLOATS,
              st.text(alphabet="RS01x", max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=2)),
    max_leaves=5)


@SETTINGS
@given(data=st.data(), refingerprint=st.booleans(), cut=st.one_of(st.none(), st.integers(0, 4000)))
def plan_json(data, refingerprint, cut):
    from automap.planner.plan import Plan
    from automap.planner.validate import content_fingerprint

    record = copy.deepcopy(_plan_record())
    paths = [p for p in _paths(record) if p]
    path = data.draw(st.sampled_from(paths))
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(JSON_VALUES)
    if refingerprint:
        record["content_fingerprint"] = content_fingerprint(record)
    text = json.dumps(record)
    if cut is not None:
        text = text[:cut]
    with tempfile.TemporaryDirectory() as folder:
        file = os.path.join(folder, "plan.json")
        with open(file, "w") as f:
            f.write(text)
        plan = ok_or_typed(Plan.from_json, file)
    if plan is not None:
        plan.explain()
        ok_or_typed(plan.check_matches, _traced()["traced"])


CLI_VALUES = st.one_of(st.sampled_from(["16G", "1e999GiB", "nan", "-1", "0", "2x2", "0x2", "x",
                                        "1.5", "inf", "", "4", "1e-300", "/nodir/p.json",
                                        "bogus", "cpu"]), st.text(max_size=5))


@SETTINGS
@given(command=st.sampled_from(["plan", "explain", "estimate", "detect"]),
       options=st.lists(st.tuples(st.sampled_from(
           ["--memory", "--mesh", "--flops", "--alpha-s", "--bandwidth", "--time-limit",
            "--batch", "--device", "--rows", "-o", "--local", "--iters", "--sizes",
            "--timeout", "--optimizer", "--checkpointing"]), CLI_VALUES), max_size=4),
       target=st.sampled_from(["factory", "missing", "junk"]))
def command_line(command, options, target):
    from automap.cli import main

    folder = tempfile.mkdtemp()
    factory = os.path.join(folder, "factory.py")
    with open(factory, "w") as f:
        f.write("import torch\ndef build(batch=8):\n    m = torch.nn.Linear(8, 4)\n"
                "    return m, (torch.randn(batch, 8),), lambda out: out.pow(2).mean()\n")
    plan_file = os.path.join(folder, "plan.json")
    with open(plan_file, "w") as f:
        f.write('{"schema_version": 2')
    first = {"factory": f"{factory}:build", "missing": f"{folder}/none.py:f", "junk": ":"}[target]
    argv = [command] if command == "detect" else [command, plan_file if command == "explain"
                                                  else first]
    if command == "plan":
        argv += ["--mesh", "2"]
    if command == "detect":
        argv += ["-o", os.path.join(folder, "c.json"), "--local", "0"]  # never spawns
    for name, value in options:
        argv += [name, value]
    with contextlib.redirect_stderr(io.StringIO()), _quiet():
        try:
            status = main(argv)
        except SystemExit as done:  # argparse's usage errors
            status = done.code
    assert status in (0, 1, 2), status


def _one_rank_module():
    """A generated module on a 1-process gloo group (its input checks run locally)."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    case = _traced()
    if "module" not in case:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=60))
        with _quiet():
            case["module"] = automap.autoparallelize(case["model"], case["inputs"],
                                                     loss_fn=case["loss"], flops_per_s=1e6)
    return case["module"]


@SETTINGS
@given(shape=st.lists(st.integers(0, 9), max_size=3),
       dtype=st.sampled_from(["float32", "float64", "int64", "bool", "float16"]),
       extra=st.sampled_from([(), ("more",), (1,)]), keyword=st.booleans())
def module_inputs(shape, dtype, extra, keyword):
    import torch

    module = _one_rank_module()
    x = torch.zeros(shape, dtype=getattr(torch, dtype))
    if keyword:
        ok_or_typed(module, x=x)
    else:
        loss = ok_or_typed(module, x, *extra)
        if loss is not None:
            assert tuple(x.shape) == (8, 8) and x.dtype == torch.float32 and not extra


TARGETS = {f.__name__: f for f in (meshes, meshes_specs_layouts, planning, plan_json,
                                   command_line, module_inputs)}

if __name__ == "__main__":
    TARGETS[sys.argv[1]]()
