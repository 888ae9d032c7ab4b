"""The Plan: the contract between search and execution. Per node the chosen
strategy, per edge the layout conversion, the predicted step time split into
compute and communication, and the predicted peak memory per device.
Versioned JSON, loadable without re-solving; it refuses to load against a
different graph or mesh."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from automap.checkpoint.record import CheckpointPlan
from automap.errors import AutomapError, InvalidPlanError, StalePlanError
from automap.planner.pipeline_record import PipelineRecord
from automap.planner.validate import (
    SCHEMA_VERSION,
    check_against_graph,
    check_consistency,
    check_schema,
    content_fingerprint,
)
from automap.sharding.mesh import DeviceMesh
from automap.trace.mixed_precision import MixedPrecision, describe

if TYPE_CHECKING:
    from automap.planner.plot import MeasuredMemory
    from automap.trace.tracing import TracedGraph


@dataclass
class NodePlan:
    name: str
    op: str
    kind: str
    module_path: str
    inputs: list[str]  # the spec each tensor input must arrive in
    outputs: list[str]
    compute_s: float
    forward_comm_s: float
    backward_comm_s: float
    alternatives: list[dict] = field(default_factory=list)  # next best, with extra seconds
    # The collectives the node runs itself: outputs partial over these mesh axes
    # are all-reduced (scatter_dim None) or reduce-scattered onto scatter_dim;
    # input i's gradient is all-reduced over grad_reduce_axes[i] in the backward.
    # Additive inputs (biases) of a node with partial axes are added once, after
    # the reduction.
    partial_axes: list[int] = field(default_factory=list)
    scatter_dim: int | None = None
    grad_reduce_axes: list[list[int]] = field(default_factory=list)


@dataclass
class EdgePlan:
    producer: str
    output_index: int
    consumer: str
    input_index: int
    src: str
    dst: str
    shape: list[int]
    dtype_bytes: int
    steps: list[str]
    cost_s: float


@dataclass
class Plan:
    mesh: DeviceMesh
    nodes: dict[str, NodePlan]
    edges: list[EdgePlan]
    predicted_step_s: float
    predicted_compute_s: float
    predicted_communication_s: float
    predicted_peak_memory_bytes: float
    memory_budget_bytes: float | None
    memory_binding: bool
    graph_fingerprint: str
    cost_constants: dict
    solver: dict
    unsupported_ops: dict[str, int] = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    #: Activation checkpointing (None: every activation is kept for the backward).
    checkpoint: CheckpointPlan | None = None
    #: The example inputs' form, shapes and dtypes (``automap.trace.example_inputs``).
    inputs: dict | None = None
    #: What is live at the predicted peak, bytes by category, and where the peak
    #: is (from the simulated step of the generated program when the plan was
    #: verified, else from the planner's memory model).
    memory_breakdown: dict = field(default_factory=dict)
    memory_breakdown_at: str = ""
    #: The predicted step's parts in seconds (``automap.planner.step_time.StepTime``).
    step_time: dict = field(default_factory=dict)
    #: Live bytes by category over the simulated step (None: not simulated):
    #: ``{"categories": [...], "samples": [{"at", "phase", "node", "bytes"}]}``,
    #: ``at`` the fraction of the step's allocations and frees before the sample,
    #: ``bytes`` one count per category; the largest sample sums to the peak.
    memory_timeline: dict | None = None
    #: The ``MixedPrecision`` the plan's graph computes in (None: the model's dtypes).
    mixed_precision: MixedPrecision | None = None
    #: Pipeline stages (issue 18; None: one stage, the whole mesh runs every node).
    pipeline: PipelineRecord | None = None

    # Serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        data = {
            "schema_version": SCHEMA_VERSION,
            "versions": self.versions or current_versions(),
            "graph_fingerprint": self.graph_fingerprint,
            "mesh": self.mesh.to_dict(),
            "cost_constants": self.cost_constants,
            "solver": self.solver,
            "predicted_step_s": self.predicted_step_s,
            "predicted_compute_s": self.predicted_compute_s,
            "predicted_communication_s": self.predicted_communication_s,
            "predicted_peak_memory_bytes": self.predicted_peak_memory_bytes,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_binding": self.memory_binding,
            "memory_breakdown": self.memory_breakdown,
            "memory_breakdown_at": self.memory_breakdown_at,
            "unsupported_ops": self.unsupported_ops,
            "checkpoint": self.checkpoint.to_dict() if self.checkpoint else None,
            "inputs": self.inputs,
            "step_time": self.step_time,
            "nodes": [asdict(n) for n in self.nodes.values()],
            "edges": [asdict(e) for e in self.edges],
        }
        if self.memory_timeline is not None:  # absent otherwise, as in older plans
            data["memory_timeline"] = self.memory_timeline
        if self.mixed_precision is not None:  # absent otherwise: older plans read alike
            data["mixed_precision"] = self.mixed_precision.to_dict()
        if self.pipeline is not None:  # absent otherwise: older plans read alike
            data["pipeline"] = self.pipeline.to_dict()
        # Through JSON once, so the hash sees what a reader will (lists, not tuples).
        data = json.loads(json.dumps(data))
        data["content_fingerprint"] = content_fingerprint(data)
        return data

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """The plan of ``to_dict``. Refuses (``InvalidPlanError``) a record with a
        field of the wrong type or range, content that does not match its
        fingerprint (edited by hand) or that disagrees with itself or its mesh;
        another schema version is a ``StalePlanError``."""
        check_schema(data)
        try:
            mesh = DeviceMesh.from_dict(data["mesh"])
        except AutomapError as exc:
            raise InvalidPlanError(f"plan field mesh: {exc}") from None
        plan = cls(
            mesh=mesh,
            nodes={n["name"]: NodePlan(**n) for n in data["nodes"]},
            edges=[EdgePlan(**e) for e in data["edges"]],
            predicted_step_s=data["predicted_step_s"],
            predicted_compute_s=data["predicted_compute_s"],
            predicted_communication_s=data["predicted_communication_s"],
            predicted_peak_memory_bytes=data["predicted_peak_memory_bytes"],
            memory_budget_bytes=data["memory_budget_bytes"],
            memory_binding=data["memory_binding"],
            memory_breakdown=data["memory_breakdown"],
            memory_breakdown_at=data["memory_breakdown_at"],
            graph_fingerprint=data["graph_fingerprint"],
            cost_constants=data["cost_constants"],
            solver=data["solver"],
            unsupported_ops=data["unsupported_ops"],
            versions=data["versions"],
            checkpoint=CheckpointPlan.from_dict(data["checkpoint"]),
            inputs=data["inputs"],
            step_time=data["step_time"],
            memory_timeline=data.get("memory_timeline"),
            mixed_precision=(MixedPrecision.from_dict(data["mixed_precision"])
                             if data.get("mixed_precision") is not None else None),
            pipeline=PipelineRecord.from_dict(data.get("pipeline")),
        )
        check_consistency(plan)
        return plan

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Plan:
        """``from_dict`` of a JSON file, or of the text ``to_json()`` returns (a
        string that starts with ``{``); unreadable JSON is an
        ``InvalidPlanError``, a file that cannot be opened an ``OSError``."""
        if isinstance(path, str) and path.lstrip().startswith("{"):
            text, path = path, "the JSON text given"
        else:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidPlanError(f"{path} is not a plan: not UTF-8 text ({exc.reason} "
                                       f"at byte {exc.start})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidPlanError(f"{path} is not a plan: invalid JSON at line {exc.lineno}, "
                                   f"column {exc.colno} ({exc.msg}); was it cut short?") from None
        return cls.from_dict(data)

    def check_matches(self, traced: TracedGraph, mesh: DeviceMesh | None = None) -> None:
        """Raise StalePlanError unless this plan was made for ``traced`` (and
        ``mesh``), and InvalidPlanError unless every node's choice is a strategy
        the generator offers for it."""
        self.check_generable()
        traced_setting = getattr(traced, "mixed_precision", None)
        if traced_setting != self.mixed_precision:
            raise StalePlanError(
                f"this plan was made for {describe(self.mixed_precision)}, but the model is "
                f"run in {describe(traced_setting)}; pass the plan's setting "
                f"(mixed_precision=plan.mixed_precision) or re-plan")
        fingerprint = graph_fingerprint(traced)
        if fingerprint != self.graph_fingerprint:
            raise StalePlanError(
                "this plan was made for a different graph (the model, its input shapes or the "
                "torch version changed since planning); re-plan with automap.plan(model, "
                "example_inputs, ...)")
        if mesh is not None and mesh.shape != self.mesh.shape:
            raise StalePlanError(
                f"this plan is for a mesh of shape {self.mesh.shape}, not {mesh.shape}; re-plan "
                f"for this mesh")
        check_against_graph(self, traced)

    def check_generable(self) -> None:
        """Raise StalePlanError for a plan made with ``reduce_depth=True``: it
        was planned on a few traced layers standing for all of them, an
        estimate of the whole model's plan; its graph is not the model's, so
        no program can be generated from it (without this check the graph
        fingerprint refused it as if the model had changed)."""
        reduced = self.solver.get("reduced_depth")
        if reduced:
            layers = ", ".join(f"{path or 'model'}: {kept} of {depth} layers"
                               for path, depth, kept in reduced)
            raise StalePlanError(
                f"this plan was made with reduce_depth=True (planned on {layers}): an "
                "estimate for sizing the run, which cannot be applied; re-plan without "
                "reduce_depth to train with it")

    # Explanation --------------------------------------------------------------------
    def placements(self, model: torch.nn.Module | None = None) -> dict[str, tuple]:
        """Every parameter's and buffer's DTensor placements under this plan, by the
        user's name: one placement per mesh axis (``Shard(d)``, ``_StridedShard`` where
        a dim's axes are out of mesh order, ``Replicate()``), those the generated
        module's ``state_dict()`` holds. ``model`` (any device, meta too) makes the
        names exact and gives tied names their shared tensor's placements; without
        it names come from the plan's placeholders (``automap.planner.placements``).
        Needs no process group."""
        from automap.planner.placements import state_placements

        return state_placements(self, model)

    def summary(self) -> str:
        if self.pipeline is not None:
            return self._pipeline_summary(self.pipeline)
        budget = ("no memory budget" if self.memory_budget_bytes is None
                  else f"budget {format_bytes(self.memory_budget_bytes)}"
                  + (", binding" if self.memory_binding else ""))
        blocks = self.checkpoint.block_count() if self.checkpoint else 0
        checkpointing = (f", {_count(blocks, 'checkpoint block')} (recomputation "
                         f"{self.checkpoint.recompute_s * 1e3:.3f} ms)"
                         if self.checkpoint and blocks else "")
        return (
            f"plan on mesh {self.mesh.shape}: predicted step {self.predicted_step_s * 1e3:.3f} ms "
            f"(compute {self.predicted_compute_s * 1e3:.3f} ms, communication "
            f"{self.predicted_communication_s * 1e3:.3f} ms{self._overlap()}), peak memory "
            f"{format_bytes(self.predicted_peak_memory_bytes)} per device ({budget})"
            + checkpointing
            + f"; solver {self.solver.get('status')} "
            f"in {self.solver.get('solve_s', 0):.2f} s, gap {self.solver.get('gap', 0):.2g}")

    def _pipeline_summary(self, pipe: PipelineRecord) -> str:
        budget = ("no memory budget" if self.memory_budget_bytes is None
                  else f"budget {format_bytes(self.memory_budget_bytes)}")
        intra = ("intra-op only: not planned, a stage count was asked"
                 if pipe.intra_op_step_s is None else
                 f"intra-op only on the whole mesh {tuple(pipe.mesh['shape'])}: "
                 f"{pipe.intra_op_step_s * 1e3:.3f} ms")
        return (f"pipeline plan: {_count(pipe.stage_count, 'stage')} of submesh "
                f"{tuple(pipe.submesh_shape)} over mesh {tuple(pipe.mesh['shape'])}, "
                f"{pipe.microbatches} microbatch{'es' if pipe.microbatches != 1 else ''} "
                f"({pipe.schedule}{_chunks(pipe)}): predicted step "
                f"{self.predicted_step_s * 1e3:.3f} ms "
                f"({intra}), peak memory {format_bytes(self.predicted_peak_memory_bytes)} "
                f"per device ({budget})")

    def _pipeline_lines(self, pipe: PipelineRecord) -> list[str]:
        """The stages: node range, ranks, per-microbatch times and peak memory."""
        lines = [f"pipeline stages ({pipe.schedule}, {pipe.microbatches} microbatches; every "
                 f"stage runs the nodes below on its submesh {tuple(pipe.submesh_shape)} with "
                 f"the specs of this plan; times per microbatch on one rank, with the sends"
                 + (f"; {pipe.virtual_stages} chunks per rank, chunk j on submesh j mod "
                    f"{pipe.stage_count}, the peak per rank, all its chunks together"
                    if pipe.virtual_stages > 1 else "") + "):"]
        rows = []
        for stage in pipe.stages:
            first = stage.first_node + (f"#{stage.first_repeat}" if stage.first_repeat else "")
            last = stage.last_node + (f"#{stage.last_repeat}" if stage.last_repeat else "")
            ranks = list(stage.ranks)
            shown = (f"{ranks}" if len(ranks) <= 8 else
                     f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)})")
            rows.append((str(stage.index), f"{first} .. {last}", shown,
                         f"{stage.predicted_forward_s * 1e3:.3f}",
                         f"{stage.predicted_backward_s * 1e3:.3f}",
                         format_bytes(stage.predicted_peak_memory_bytes),
                         "recomputes its forward" if stage.recompute else ""))
        head = ("chunk" if pipe.virtual_stages > 1 else "stage", "nodes", "ranks", "forward ms",
                "backward ms", "peak", "")
        widths = [max(len(head[c]), *(len(r[c]) for r in rows)) for c in range(7)]
        lines.append(("  " + "  ".join(f"{h:{w}}" for h, w in zip(head, widths))).rstrip())
        lines.extend(("  " + "  ".join(f"{c:{w}}" for c, w in zip(r, widths))).rstrip()
                     for r in rows)
        sends = ", ".join(f"{s * 1e3:.3f}" for s in pipe.send_s)
        lines.append(f"  activation sends per microbatch (ms, per boundary): {sends or '-'}; "
                     f"after the last microbatch: gradient sync and optimizer "
                     f"{pipe.tail_s * 1e3:.3f} ms, tied weights' all-reduce "
                     f"{pipe.tied_s * 1e3:.3f} ms")
        per_stage = self.solver.get("pipeline_stage_plans")
        if per_stage:
            # Stages running different submesh plans (``pipeline_merge``).
            lines.append("  intra-op plan per " + ("chunk" if pipe.virtual_stages > 1 else "stage")
                         + " (of the submesh plans the search made; the specs above are "
                         "each one's): " + ", ".join(
                             f"{k}: #{p['plan']} ({p['intra_op_step_s'] * 1e3:.3f} ms, "
                             f"{format_bytes(p['intra_op_peak_bytes'])} for the whole model)"
                             for k, p in enumerate(per_stage)))
        if pipe.intra_op_step_s is not None:
            lines.append(f"  predicted step: pipeline {pipe.predicted_step_s * 1e3:.3f} ms vs "
                         f"intra-op only {pipe.intra_op_step_s * 1e3:.3f} ms")
        return lines

    def _memory_lines(self) -> list[str]:
        """The predicted peak per device and what is live there, by category."""
        source = ("the simulated step and its reserve" if self.solver.get("simulated")
                  else "the memory model")
        where = f" ({self.memory_breakdown_at})" if self.memory_breakdown_at else ""
        optimizer = self.cost_constants.get("optimizer")
        impl = self.cost_constants.get("optimizer_impl")
        stepping = f"; {optimizer} stepping with {impl} kernels" if optimizer and impl else ""
        lines = [f"peak memory per device {format_bytes(self.predicted_peak_memory_bytes)}"
                 f"{where}, from {source}{stepping}:"]
        parts = sorted(((v, k) for k, v in self.memory_breakdown.items() if v > 0),
                       reverse=True)
        width = max((len(k) for _, k in parts), default=0)
        lines.extend(f"  {k:{width}}  {format_bytes(v):>10}" for v, k in parts)
        return lines

    def _overlap(self) -> str:
        t = self.step_time
        if not t:
            return ""
        return (f"; gradient sync {t['gradient_sync_s'] * 1e3:.3f} ms, "
                f"{t['exposed_sync_s'] * 1e3:.3f} ms not hidden by the backward; optimizer "
                f"{t['optimizer_s'] * 1e3:.3f} ms")

    def explain(self, max_rows: int | None = 60) -> str:
        """A table per node of the chosen specs, its cost and its best
        alternatives, the layout conversions, and which constraint binds.
        ``max_rows``: the slowest nodes listed (None: all)."""
        lines = [self.summary(), ""]
        compared = self.solver.get("compared_step_s") or {}
        if compared.get("searched") is not None and compared.get("parameters whole") is not None:
            # A pipeline's comparison was its submesh plan's, not the pipeline's.
            what = ("the stages' submesh plan (one microbatch) was " if self.pipeline
                    is not None else "")
            lines[1:1] = [
                f"{what}chosen over the search's plan ({compared['searched'] * 1e3:.3f} ms): the "
                f"fastest plan with every parameter whole "
                f"({compared['parameters whole'] * 1e3:.3f} ms; the program all-reduces its "
                f"gradients in buckets beside the backward)", ""]
        if self.pipeline is not None:
            lines.extend([*self._pipeline_lines(self.pipeline), ""])
        listed = [n for n in self.nodes.values() if n.kind not in ("output",)]
        listed.sort(key=lambda n: -(n.compute_s + n.forward_comm_s + n.backward_comm_s))
        shown = listed if max_rows is None else listed[:max_rows]
        rows = [(n.name, n.op, f"{','.join(n.inputs) or '-'} -> {','.join(n.outputs)}",
                 f"{(n.compute_s + n.forward_comm_s + n.backward_comm_s) * 1e3:.4f}",
                 "; ".join(f"{','.join(a['outputs'])} {a['extra_s'] * 1e3:+.3f} ms"
                           for a in n.alternatives[:2]))
                for n in shown]
        head = ("node", "op", "inputs -> outputs", "time ms", "alternatives")
        widths = [max([len(head[c])] + [len(r[c]) for r in rows]) for c in range(4)]

        def line(cells: Sequence[str]) -> str:
            return (f"{cells[0]:{widths[0]}}  {cells[1]:{widths[1]}}  {cells[2]:{widths[2]}}  "
                    f"{cells[3]:>{widths[3]}}  {cells[4]}").rstrip()

        lines.append(line(head))
        lines.append("-" * len(line(head)))
        lines.append("(alternatives: other output specs and their node time relative to the "
                     "chosen one, before the conversions they would need)")
        lines.extend(line(r) for r in rows)
        if len(shown) < len(listed):
            lines.append(f"... and {len(listed) - len(shown)} more nodes (explain(max_rows=None)"
                         f" or automap explain --rows {len(listed)} lists all {len(listed)})")
        in_nodes = sum(n.forward_comm_s + n.backward_comm_s for n in self.nodes.values())
        conversions = [e for e in self.edges if e.steps]
        lines.append("")
        lines.append(f"communication: {in_nodes * 1e3:.3f} ms inside nodes (partial-sum "
                     f"reductions and gradient all-reduces), "
                     f"{_count(len(conversions), 'layout conversion')} between nodes: "
                     f"{sum(e.cost_s for e in conversions) * 1e3:.3f} ms (summed over the traced "
                     f"nodes)")
        for e in sorted(conversions, key=lambda e: -e.cost_s)[:10]:
            lines.append(f"  {e.producer} -> {e.consumer}: {e.src} -> {e.dst} "
                         f"({', '.join(e.steps)}) {e.cost_s * 1e3:.4f} ms")
        lines.append("")
        lines.extend(self._memory_lines())
        if self.memory_budget_bytes is not None:
            lines.append("the memory budget binds: a faster plan would not fit"
                         if self.memory_binding else "the memory budget does not bind")
        if self.checkpoint is not None:
            lines.append("")
            lines.extend(self.checkpoint.describe())
        if self.unsupported_ops:
            lines.append(f"ran replicated (no generator): {self.unsupported_ops}")
        return "\n".join(lines)

    # Pictures (matplotlib: pip install automap[plot]) -------------------------------
    def plot(self, path: str) -> str:
        """Draw the graph's nodes coloured by their sharding, the layout conversions
        and checkpoint blocks, and each node's time, to ``path`` (PNG by suffix)."""
        from automap.planner.plot import plot_plan

        return plot_plan(self, path)

    def plot_memory(self, path: str, measured: MeasuredMemory | None = None) -> str:
        """Draw the predicted memory per rank over the step by category, the budget
        and, given ``measured`` (an ``automap.planner.plot.MeasuredMemory`` or
        (fraction of the step, bytes) pairs), the measured curve, to ``path``."""
        from automap.planner.plot import plot_memory

        return plot_memory(self, path, measured)

    def __str__(self) -> str:
        return self.summary()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps a number >= 1 (B, KiB ... TiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def current_versions() -> dict:
    from automap.version import __version__

    return {"automap": __version__, "torch": torch.__version__}


def graph_fingerprint(traced: TracedGraph) -> str:
    """A hash of the graph's ops, tensor shapes and dtypes, and its wiring."""
    h = hashlib.sha256()
    for node in traced.graph.nodes:
        val = node.meta.get("val")
        leaves = val if isinstance(val, (list, tuple)) else [val]
        shapes = [(tuple(v.shape), str(v.dtype)) for v in leaves if isinstance(v, torch.Tensor)]
        args = [a.name for a in node.all_input_nodes]
        h.update(repr((node.op, str(node.target), shapes, args)).encode())
    return h.hexdigest()[:32]


def _chunks(pipe: PipelineRecord) -> str:
    """``, v chunks per rank`` for an interleaved pipeline."""
    return f", {pipe.virtual_stages} chunks per rank" if pipe.virtual_stages > 1 else ""
