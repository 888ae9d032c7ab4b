"""Validation of plans read from JSON, in three layers, each an
``InvalidPlanError`` naming the field, the value and what is allowed:

1. ``check_schema``: every field has its type and range (a typed reading of
   ``Plan.to_dict``'s layout: no extra or missing keys, integers that are not
   booleans, finite non-negative times, spec strings that parse).
2. ``check_consistency``: the plan agrees with itself and its mesh (mesh axes in
   range, edges between existing nodes carrying the specs those nodes chose,
   specs that divide the recorded shapes, checkpoint blocks nested in range).
3. ``check_against_graph``: the plan fits the traced graph it will run: the same
   nodes and edges, and every node's choice (input and output specs, partial-sum
   axes, scatter dim, gradient reductions) is one of the strategies the
   generator offers for that node's op on the mesh.

The content fingerprint (``content_fingerprint``) is a hash of everything else
in the record, so a plan edited after automap wrote it is refused before any
of this runs."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import warnings

from automap.errors import AutomapError, InvalidPlanError, StalePlanError

#: The plan record's version. 2: records carry content_fingerprint, and every
#: field is checked on load.
SCHEMA_VERSION = 2

NODE_FIELDS = {"name": str, "op": str, "kind": str, "module_path": str, "inputs": "specs",
               "outputs": "specs", "compute_s": "seconds", "forward_comm_s": "seconds",
               "backward_comm_s": "seconds", "alternatives": "alternatives",
               "partial_axes": "axes",
               "scatter_dim": "index?", "grad_reduce_axes": "axes_list"}
EDGE_FIELDS = {"producer": str, "output_index": "index", "consumer": str,
               "input_index": "index", "src": "spec", "dst": "spec", "shape": "shape",
               "dtype_bytes": "dtype_bytes", "steps": "strings", "cost_s": "seconds"}
CHECKPOINT_FIELDS = {"stages": "names_list", "blocks": list, "activation_budget_bytes": "index",
                     "persistent_bytes": "index", "predicted_activation_peak_bytes": "index",
                     "recompute_s": "seconds", "ilp_budget_bytes": "bytes?",
                     "timeline": "timeline"}
PIPELINE_FIELDS = {"mesh": dict, "submesh_shape": list, "microbatches": "index",
                   "schedule": str, "stages": list, "predicted_step_s": "seconds",
                   "send_s": list, "intra_op_step_s": "seconds?"}
#: Written since the stage search fills them (absent: zero).
OPTIONAL_PIPELINE_FIELDS = {"tail_s": "seconds", "tied_s": "seconds", "virtual_stages": "index"}
OPTIONAL_PIPELINE_STAGE_FIELDS = {"first_repeat": "index", "last_repeat": "index",
                                  "recompute": bool, "modelled_peak_memory_bytes": "bytes?"}
PIPELINE_STAGE_FIELDS = {"index": "index", "first_node": str, "last_node": str, "ranks": list,
                         "predicted_forward_s": "seconds", "predicted_backward_s": "seconds",
                         "predicted_peak_memory_bytes": "bytes"}
TOP_FIELDS = {"schema_version": "index", "versions": dict, "graph_fingerprint": str,
              "content_fingerprint": str, "mesh": dict, "cost_constants": dict,
              "solver": "solver",
              "predicted_step_s": "seconds", "predicted_compute_s": "seconds",
              "predicted_communication_s": "seconds", "predicted_peak_memory_bytes": "bytes",
              "memory_budget_bytes": "bytes?", "memory_binding": bool,
              "memory_breakdown": "breakdown", "memory_breakdown_at": str,
              "unsupported_ops": dict, "checkpoint": "checkpoint?", "inputs": "inputs?",
              "step_time": "breakdown", "nodes": list, "edges": list}
#: Top-level fields a record may lack (written only when set; plans written
#: before they existed load, with the same content fingerprint): the simulated
#: step's memory over time, the mixed-precision setting.
OPTIONAL_TOP_FIELDS = {"memory_timeline": "memory_timeline?",
                       "mixed_precision": "mixed_precision?",
                       "pipeline": "pipeline?"}
INPUT_FORMS = ("tensor", "sequence", "dict")


def content_fingerprint(data: dict) -> str:
    """A hash of a plan record's content (every field but this fingerprint)."""
    content = {k: v for k, v in data.items() if k != "content_fingerprint"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _fail(where: str, value, allowed: str):
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise InvalidPlanError(f"plan field {where} is {shown}; {allowed}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_value(where: str, value, kind) -> None:
    from automap.sharding.spec import ShardingSpec

    if isinstance(kind, type):
        if kind is dict and not isinstance(value, dict) or kind is list and \
                not isinstance(value, list) or kind is str and not isinstance(value, str) or \
                kind is bool and not isinstance(value, bool):
            _fail(where, value, f"it must be a {kind.__name__}")
        return
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if optional and value is None:
        return
    if kind == "index":
        if not _is_int(value) or value < 0:
            _fail(where, value, "it must be an integer >= 0")
    elif kind == "seconds":
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            _fail(where, value, "it must be a finite number of seconds >= 0")
    elif kind == "bytes":
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            _fail(where, value, "it must be a finite number of bytes >= 0")
    elif kind == "dtype_bytes":
        if not _is_int(value) or not 1 <= value <= 16:
            _fail(where, value, "it must be an integer from 1 to 16")
    elif kind == "shape":
        if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
            _fail(where, value, "it must be a list of integers >= 0")
    elif kind in ("spec", "specs"):
        specs = [value] if kind == "spec" else value
        if not isinstance(specs, list):
            _fail(where, value, "it must be a list of sharding spec strings")
        for spec in specs:
            if not isinstance(spec, str):
                _fail(where, value, "specs are strings such as 'S0R'")
            try:
                ShardingSpec.parse(spec)
            except AutomapError as exc:
                _fail(where, value, str(exc))
    elif kind == "strings":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            _fail(where, value, "it must be a list of strings")
    elif kind == "names_list":
        if not isinstance(value, list) or not all(
                isinstance(s, list) and all(isinstance(n, str) for n in s) for s in value):
            _fail(where, value, "it must be a list of lists of node names")
    elif kind == "axes":
        if not isinstance(value, list) or not all(_is_int(a) and a >= 0 for a in value):
            _fail(where, value, "it must be a list of mesh axes (integers >= 0)")
    elif kind == "axes_list":
        if not isinstance(value, list):
            _fail(where, value, "it must be a list of lists of mesh axes")
        for i, axes in enumerate(value):
            _check_value(f"{where}[{i}]", axes, "axes")
    elif kind == "alternatives":
        if not isinstance(value, list):
            _fail(where, value, "it must be a list of alternatives")
        for i, alt in enumerate(value):
            _check_record(f"{where}[{i}]", alt, {"inputs": "specs", "outputs": "specs",
                                                  "extra_s": "number"})
    elif kind == "number":
        if not _is_number(value) or not math.isfinite(value):
            _fail(where, value, "it must be a finite number")
    elif kind == "timeline":
        if not isinstance(value, list) or not all(
                isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
                and _is_int(t[1]) and _is_int(t[2]) for t in value):
            _fail(where, value, "it must be a list of [op, stage, bytes]")
    elif kind == "solver":
        if not isinstance(value, dict) or not all(
                _is_number(value[k]) for k in ("gap", "solve_s") if k in value):
            _fail(where, value, "it must be an object whose gap and solve_s are numbers")
    elif kind == "breakdown":
        if not isinstance(value, dict) or not all(
                isinstance(k, str) and _is_number(v) and math.isfinite(v)
                for k, v in value.items()):
            _fail(where, value, "it must map names to finite numbers")
    elif kind == "checkpoint":
        _check_record(where, value, CHECKPOINT_FIELDS)
    elif kind == "memory_timeline":
        _check_memory_timeline(where, value)
    elif kind == "inputs":
        _check_inputs(where, value)
    elif kind == "mixed_precision":
        _check_mixed_precision(where, value)
    elif kind == "pipeline":
        _check_record(where, value, PIPELINE_FIELDS, OPTIONAL_PIPELINE_FIELDS)
        for i, stage in enumerate(value["stages"] if isinstance(value["stages"], list) else ()):
            _check_record(f"{where}.stages[{i}]", stage, PIPELINE_STAGE_FIELDS,
                          OPTIONAL_PIPELINE_STAGE_FIELDS)
    else:  # pragma: no cover - the tables above name only the kinds handled here
        raise AssertionError(kind)


def _check_record(where: str, record, spec: dict, optional: dict | None = None) -> None:
    if not isinstance(record, dict):
        _fail(where, record, "it must be a JSON object")
    optional = optional or {}
    missing = sorted(set(spec) - set(record))
    extra = sorted(set(record) - set(spec) - set(optional))
    if missing or extra:
        _fail(where, sorted(record), f"missing fields {missing}, unknown fields {extra}")
    for key, kind in (*spec.items(), *optional.items()):
        if key in record:
            _check_value(f"{where}.{key}", record[key], kind)


def _check_memory_timeline(where: str, value) -> None:
    """``{"categories": [names], "samples": [{"at", "phase", "node", "bytes"}]}``:
    ``at`` a fraction of the step, ``bytes`` one count >= 0 per category."""
    if not isinstance(value, dict) or set(value) != {"categories", "samples"}:
        _fail(where, value, "it must be an object with categories and samples")
    categories = value["categories"]
    _check_value(f"{where}.categories", categories, "strings")
    if not isinstance(value["samples"], list):
        _fail(f"{where}.samples", value["samples"], "it must be a list of samples")
    for i, sample in enumerate(value["samples"]):
        at = f"{where}.samples[{i}]"
        _check_record(at, sample, {"at": "number", "phase": str, "node": str, "bytes": "shape"})
        if not 0 <= sample["at"] <= 1:
            _fail(f"{at}.at", sample["at"], "it must be a fraction of the step, 0 to 1")
        if len(sample["bytes"]) != len(categories):
            _fail(f"{at}.bytes", sample["bytes"],
                  f"it needs one byte count per category ({len(categories)})")


def _check_inputs(where: str, value) -> None:
    import torch

    if not isinstance(value, dict) or set(value) != {"form", "args", "kwargs"}:
        _fail(where, value, "it must be an object with form, args and kwargs")
    if value["form"] not in INPUT_FORMS:
        _fail(f"{where}.form", value["form"], f"it must be one of {list(INPUT_FORMS)}")
    if not isinstance(value["args"], list) or not isinstance(value["kwargs"], dict):
        _fail(where, value, "args must be a list and kwargs an object")
    records = [(f"{where}.args[{i}]", r) for i, r in enumerate(value["args"])]
    records += [(f"{where}.kwargs.{k}", r) for k, r in value["kwargs"].items()]
    for at, record in records:
        if not isinstance(record, dict):
            _fail(at, record, "it must be an object")
        if "shape" in record:
            _check_value(f"{at}.shape", record["shape"], "shape")
            dtype = getattr(torch, str(record.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                _fail(f"{at}.dtype", record.get("dtype"), "it must name a torch dtype")
            if "fill" in record and not _is_number(record["fill"]):
                _fail(f"{at}.fill", record["fill"], "it must be a number")
        elif not ("value" in record or "unrecordable" in record):
            _fail(at, record, "it must hold a shape and dtype, a value or 'unrecordable'")


def _check_mixed_precision(where: str, value) -> None:
    from automap.trace.mixed_precision import MixedPrecision

    if not isinstance(value, dict) or set(value) != {"param_dtype", "reduce_dtype"}:
        _fail(where, value, "it must be an object with param_dtype and reduce_dtype")
    try:
        MixedPrecision.from_dict(value)
    except AutomapError as exc:
        _fail(where, value, str(exc))


def check_schema(data) -> None:
    """Layer 1: the types and ranges of every field."""
    if not isinstance(data, dict):
        _fail("(top level)", data, "a plan is a JSON object")
    version = data.get("schema_version")
    if not _is_int(version) or version != SCHEMA_VERSION:
        raise StalePlanError(
            f"plan schema version {version!r} is not {SCHEMA_VERSION}, the one this automap "
            f"reads (an integer); re-plan with automap.plan(...)")
    _check_record("(top level)", data, TOP_FIELDS, OPTIONAL_TOP_FIELDS)
    if data["content_fingerprint"] != content_fingerprint(data):
        raise InvalidPlanError(
            "the plan's content does not match its content_fingerprint: it was changed after "
            "automap wrote it. A plan is not meant to be edited by hand; re-plan with "
            "automap.plan(...) (a forced choice goes through strategy_filter=...)")
    for i, node in enumerate(data["nodes"]):
        _check_record(f"nodes[{i}]", node, NODE_FIELDS)
    for i, edge in enumerate(data["edges"]):
        _check_record(f"edges[{i}]", edge, EDGE_FIELDS)


def check_consistency(plan) -> None:
    """Layer 2: the plan agrees with itself and with its mesh."""
    from automap.sharding.spec import ShardingSpec

    ndim = plan.mesh.ndim
    names = set(plan.nodes)
    if len(names) != len(plan.nodes):
        raise InvalidPlanError("two plan nodes have the same name")
    for node in plan.nodes.values():
        where = f"nodes[{node.name}]"
        for axis in node.partial_axes:
            if axis >= ndim:
                _fail(f"{where}.partial_axes", node.partial_axes,
                      f"mesh axes are 0 to {ndim - 1}")
        if node.partial_axes != sorted(set(node.partial_axes)):
            _fail(f"{where}.partial_axes", node.partial_axes, "axes are sorted and distinct")
        if len(node.grad_reduce_axes) not in (0, len(node.inputs)):
            _fail(f"{where}.grad_reduce_axes", node.grad_reduce_axes,
                  f"it needs one list per input ({len(node.inputs)})")
        for axes in node.grad_reduce_axes:
            if any(a >= ndim for a in axes):
                _fail(f"{where}.grad_reduce_axes", node.grad_reduce_axes,
                      f"mesh axes are 0 to {ndim - 1}")
        if node.scatter_dim is not None and (not node.partial_axes or len(node.outputs) != 1):
            _fail(f"{where}.scatter_dim", node.scatter_dim,
                  "a scatter dim needs partial axes and a single output")
    for i, edge in enumerate(plan.edges):
        where = f"edges[{i}]"
        for end, name in (("producer", edge.producer), ("consumer", edge.consumer)):
            if name not in names:
                _fail(f"{where}.{end}", name, "it must name a node of the plan")
        outs, ins = plan.nodes[edge.producer].outputs, plan.nodes[edge.consumer].inputs
        if edge.output_index >= len(outs) or outs[edge.output_index] != edge.src:
            _fail(f"{where}.src", edge.src, f"the producer's output {edge.output_index} is "
                  f"{outs[edge.output_index] if edge.output_index < len(outs) else 'missing'}")
        if edge.input_index >= len(ins) or ins[edge.input_index] != edge.dst:
            _fail(f"{where}.dst", edge.dst, f"the consumer's input {edge.input_index} is "
                  f"{ins[edge.input_index] if edge.input_index < len(ins) else 'missing'}")
        for spec in (edge.src, edge.dst):
            try:
                ShardingSpec.parse(spec).validate(edge.shape, plan.mesh)
            except AutomapError as exc:
                _fail(f"{where}.shape", edge.shape, str(exc))
    if plan.checkpoint is not None:
        _check_checkpoint(plan.checkpoint)
    if plan.pipeline is not None:
        _check_pipeline(plan)


def _check_pipeline(plan) -> None:
    """The stages partition the pipeline's mesh into submeshes of the plan's
    mesh shape (stage 0's ranks are the plan's mesh), and cover the computed
    nodes in contiguous ranges, in order; the schedule is known."""
    from automap.planner.pipeline_record import SCHEDULES
    from automap.sharding.mesh import DeviceMesh

    pipe = plan.pipeline
    if pipe.schedule not in SCHEDULES:
        _fail("pipeline.schedule", pipe.schedule, f"schedules are {list(SCHEDULES)}")
    if not _is_int(pipe.microbatches) or pipe.microbatches < 1:
        _fail("pipeline.microbatches", pipe.microbatches, "it must be an integer >= 1")
    try:
        whole = DeviceMesh.from_dict(pipe.mesh)
    except AutomapError as exc:
        raise InvalidPlanError(f"plan field pipeline.mesh: {exc}") from None
    if tuple(pipe.submesh_shape) != plan.mesh.shape:
        _fail("pipeline.submesh_shape", list(pipe.submesh_shape),
              f"it must be the plan's mesh shape {list(plan.mesh.shape)}")
    if not pipe.stages:
        _fail("pipeline.stages", [], "a pipeline has at least one stage")
    size = math.prod(pipe.submesh_shape)
    v = pipe.virtual_stages
    if not _is_int(v) or v < 1 or len(pipe.stages) % v or \
            (v > 1) != (pipe.schedule == "interleaved"):
        _fail("pipeline.virtual_stages", v, f"it must be an integer >= 1 dividing the "
              f"{len(pipe.stages)} stages, above 1 exactly for the interleaved schedule")
    n = len(pipe.stages) // v
    seen: set[int] = set()
    for k, stage in enumerate(pipe.stages):
        where = f"pipeline.stages[{k}]"
        if stage.index != k:
            _fail(f"{where}.index", stage.index, f"stages are numbered in order ({k})")
        ranks = list(stage.ranks)
        if k >= n:  # interleaved: chunk k runs on submesh k mod n
            if ranks != list(pipe.stages[k % n].ranks):
                _fail(f"{where}.ranks", ranks, f"chunk {k} runs on the ranks of chunk "
                      f"{k % n} ({list(pipe.stages[k % n].ranks)})")
            continue
        if len(ranks) != size or not all(_is_int(r) for r in ranks) or \
                seen & set(ranks) or len(set(ranks)) != size or \
                not set(ranks) <= set(whole.ranks):
            _fail(f"{where}.ranks", ranks, f"each stage holds {size} distinct ranks of the "
                  f"pipeline's mesh, no rank in two stages")
        seen.update(ranks)
    if seen != set(whole.ranks):
        _fail("pipeline.stages", f"{len(seen)} ranks", f"the stages must cover the pipeline's "
              f"mesh of {whole.size} ranks")
    if tuple(pipe.stages[0].ranks) != plan.mesh.ranks:
        _fail("pipeline.stages[0].ranks", list(pipe.stages[0].ranks),
              f"stage 0's ranks are the plan's mesh ranks {list(plan.mesh.ranks)}")
    if len(pipe.send_s) != len(pipe.stages) - 1:
        _fail("pipeline.send_s", list(pipe.send_s), "it has one entry per stage boundary")
    order = [n.name for n in plan.nodes.values()
             if n.op != "placeholder" and n.kind != "output"]
    position = {name: i for i, name in enumerate(order)}
    reduced = bool(plan.solver.get("reduced_depth"))
    previous = None
    for k, stage in enumerate(pipe.stages):
        where = f"pipeline.stages[{k}]"
        for end in ("first_node", "last_node"):
            if getattr(stage, end) not in position:
                _fail(f"{where}.{end}", getattr(stage, end), "it must name a computed node "
                      "of the plan")
        if not reduced and (stage.first_repeat or stage.last_repeat):
            _fail(f"{where}.first_repeat", stage.first_repeat, "only a depth-reduced plan "
                  "has repeated blocks")
        first = (position[stage.first_node], stage.first_repeat)
        last = (position[stage.last_node], stage.last_repeat)
        if first > last and not reduced:
            _fail(f"{where}.last_node", stage.last_node, f"it comes before the stage's first "
                  f"node {stage.first_node}")
        if previous is None:
            if first[0] != 0:
                _fail(f"{where}.first_node", stage.first_node, f"the first stage starts at "
                      f"the first computed node {order[0]}")
        elif not (first[0] == previous[0] + 1 and first[1] == 0
                  or reduced and first[1] == previous[1] + 1):
            _fail(f"{where}.first_node", stage.first_node, f"stages are contiguous: it must "
                  f"follow the previous stage's last node {order[previous[0]]}")
        previous = last
    if previous is not None and previous[0] != len(order) - 1:
        _fail(f"pipeline.stages[{len(pipe.stages) - 1}].last_node", pipe.stages[-1].last_node,
              f"the last stage ends at the last computed node {order[-1]}")


def _check_checkpoint(ck) -> None:
    def blocks(items, low, high, where):
        if not isinstance(items, list):
            _fail(where, items, "it must be a list of blocks")
        previous_end = low - 1
        for i, b in enumerate(items):
            at = f"{where}[{i}]"
            if not isinstance(b, dict) or set(b) != {"start_stage", "end_stage", "children"}:
                _fail(at, b, "a block has start_stage, end_stage and children")
            start, end = b["start_stage"], b["end_stage"]
            if not (_is_int(start) and _is_int(end) and previous_end < start <= end <= high):
                _fail(at, (start, end), f"blocks are ordered, disjoint and within stages "
                      f"{low}..{high}")
            previous_end = end
            blocks(b["children"], start, end, f"{at}.children")

    blocks(ck.blocks, 0, len(ck.stages) - 1, "checkpoint.blocks")


def check_against_graph(plan, traced) -> None:
    """Layer 3: the plan's nodes, edges and choices are those the generator can
    run on ``traced`` (strategies rebuilt without costs: no profile needed)."""
    from automap.solve.strategies import build_strategy_table

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a generator were reported at planning
        table = build_strategy_table(traced, None, plan.mesh, flops_per_s=1e12, optimizer=None)
    graph_nodes, plan_nodes = set(table.nodes), set(plan.nodes)
    if graph_nodes != plan_nodes:
        missing, unknown = sorted(graph_nodes - plan_nodes), sorted(plan_nodes - graph_nodes)
        raise InvalidPlanError(f"the plan's nodes differ from the graph's: missing "
                               f"{missing[:5]}, unknown {unknown[:5]}")
    for name, options in table.nodes.items():
        node = plan.nodes[name]
        chosen = (tuple(node.inputs), tuple(node.outputs), tuple(node.partial_axes),
                  node.scatter_dim, tuple(tuple(a) for a in node.grad_reduce_axes))
        if chosen not in _choices(options):
            raise InvalidPlanError(
                f"node {name} ({options.op}): inputs {node.inputs} -> outputs {node.outputs} "
                f"with partial axes {node.partial_axes}, scatter dim {node.scatter_dim} and "
                f"gradient reductions {node.grad_reduce_axes} is not a strategy of this op on "
                f"mesh {plan.mesh.shape}; re-plan with automap.plan(...)")
    if plan.checkpoint is not None:
        in_graph = {n.name for n in traced.graph.nodes}
        for k, stage in enumerate(plan.checkpoint.stages):
            unknown = [n for n in stage if n not in in_graph]
            if unknown:
                _fail(f"checkpoint.stages[{k}]", unknown, "stages list nodes of the graph")
    graph_edges = set(table.edges())
    plan_edges = {(e.producer, e.output_index, e.consumer, e.input_index) for e in plan.edges}
    if graph_edges != plan_edges:
        missing, unknown = sorted(graph_edges - plan_edges), sorted(plan_edges - graph_edges)
        raise InvalidPlanError(f"the plan's edges differ from the graph's: missing "
                               f"{missing[:3]}, unknown {unknown[:3]}")


def _choices(options) -> set:
    out = set()
    for i in range(len(options)):
        if options.reductions is not None:
            partial, scatter, grads = options.reductions[i]
        else:
            partial, scatter, grads = [], None, []
        grads = tuple(tuple(a) for a in grads)
        key = (tuple(options.in_specs[i]), tuple(options.out_specs[i]), tuple(partial), scatter)
        out.add((*key, grads))
        if not any(grads):  # written as [] or as one empty list per input
            out.add((*key, ()))
            out.add((*key, tuple(() for _ in options.in_specs[i])))
    return out
