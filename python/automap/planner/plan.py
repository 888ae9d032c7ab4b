"""The Plan: the contract between search and execution. Per node the chosen
strategy, per edge the layout conversion, the predicted step time split into
compute and communication, and the predicted peak memory per device.
Versioned JSON, loadable without re-solving; it refuses to load against a
different graph or mesh."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch

from automap.checkpoint.record import CheckpointPlan
from automap.errors import StalePlanError
from automap.sharding.mesh import DeviceMesh

SCHEMA_VERSION = 1


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

    # Serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
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

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StalePlanError(
                f"plan schema version {version} is not {SCHEMA_VERSION}, the one this automap "
                f"reads; re-plan with automap.plan(...)")
        return cls(
            mesh=DeviceMesh.from_dict(data["mesh"]),
            nodes={n["name"]: NodePlan(**n) for n in data["nodes"]},
            edges=[EdgePlan(**e) for e in data["edges"]],
            predicted_step_s=data["predicted_step_s"],
            predicted_compute_s=data["predicted_compute_s"],
            predicted_communication_s=data["predicted_communication_s"],
            predicted_peak_memory_bytes=data["predicted_peak_memory_bytes"],
            memory_budget_bytes=data["memory_budget_bytes"],
            memory_binding=data["memory_binding"],
            memory_breakdown=data.get("memory_breakdown", {}),
            memory_breakdown_at=data.get("memory_breakdown_at", ""),
            graph_fingerprint=data["graph_fingerprint"],
            cost_constants=data["cost_constants"],
            solver=data["solver"],
            unsupported_ops=data.get("unsupported_ops", {}),
            versions=data.get("versions", {}),
            checkpoint=CheckpointPlan.from_dict(data.get("checkpoint")),
            inputs=data.get("inputs"),
            step_time=data.get("step_time", {}),
        )

    @classmethod
    def from_json(cls, path: str) -> Plan:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def check_matches(self, traced, mesh: DeviceMesh | None = None) -> None:
        """Raise StalePlanError unless this plan was made for ``traced`` (and ``mesh``)."""
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

    # Explanation --------------------------------------------------------------------
    def summary(self) -> str:
        budget = ("unlimited" if self.memory_budget_bytes is None
                  else f"{self.memory_budget_bytes / 2**20:.1f} MiB")
        return (
            f"plan on mesh {self.mesh.shape}: predicted step {self.predicted_step_s * 1e3:.3f} ms "
            f"(compute {self.predicted_compute_s * 1e3:.3f} ms, communication "
            f"{self.predicted_communication_s * 1e3:.3f} ms{self._overlap()}), peak memory "
            f"{self.predicted_peak_memory_bytes / 2**20:.1f} MiB per device (budget {budget}"
            f"{', binding' if self.memory_binding else ''})"
            + (f", {self.checkpoint.block_count()} checkpoint blocks (recomputation "
               f"{self.checkpoint.recompute_s * 1e3:.3f} ms)" if self.checkpoint else "")
            + f"; solver {self.solver.get('status')} "
            f"in {self.solver.get('solve_s', 0):.2f} s, gap {self.solver.get('gap', 0):.2g}")

    def _overlap(self) -> str:
        t = self.step_time
        if not t:
            return ""
        return (f"; gradient sync {t['gradient_sync_s'] * 1e3:.3f} ms, "
                f"{t['exposed_sync_s'] * 1e3:.3f} ms not hidden by the backward; optimizer "
                f"{t['optimizer_s'] * 1e3:.3f} ms")

    def explain(self, max_rows: int | None = 60) -> str:
        """A table per node of the chosen specs, its cost and its best
        alternatives, and which constraint binds."""
        lines = [self.summary(), ""]
        header = f"{'node':28} {'op':22} {'inputs -> outputs':34} {'time ms':>9}  alternatives"
        lines.append(header)
        lines.append("-" * len(header))
        lines.append("(alternatives: other output specs and their node time relative to the "
                     "chosen one, before the conversions they would need)")
        interesting = [n for n in self.nodes.values() if n.kind not in ("output",)]
        interesting.sort(key=lambda n: -(n.compute_s + n.forward_comm_s + n.backward_comm_s))
        for n in interesting[:max_rows]:
            io = f"{','.join(n.inputs) or '-'} -> {','.join(n.outputs)}"
            t = (n.compute_s + n.forward_comm_s + n.backward_comm_s) * 1e3
            alts = "; ".join(f"{','.join(a['outputs'])} {a['extra_s'] * 1e3:+.3f} ms"
                             for a in n.alternatives[:2])
            lines.append(f"{n.name[:28]:28} {n.op[:22]:22} {io[:34]:34} {t:9.4f}  {alts}")
        conversions = [e for e in self.edges if e.steps]
        lines.append("")
        lines.append(f"{len(conversions)} layout conversions, "
                     f"{sum(e.cost_s for e in conversions) * 1e3:.3f} ms in all")
        for e in sorted(conversions, key=lambda e: -e.cost_s)[:10]:
            lines.append(f"  {e.producer} -> {e.consumer}: {e.src} -> {e.dst} "
                         f"({', '.join(e.steps)}) {e.cost_s * 1e3:.4f} ms")
        if self.memory_budget_bytes is not None:
            lines.append("")
            lines.append("the memory budget binds: a faster plan would not fit"
                         if self.memory_binding else "the memory budget does not bind")
        if self.checkpoint is not None:
            lines.append("")
            lines.extend(self.checkpoint.describe())
        if self.unsupported_ops:
            lines.append(f"ran replicated (no generator): {self.unsupported_ops}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def current_versions() -> dict:
    from automap.version import __version__

    return {"automap": __version__, "torch": torch.__version__}


def graph_fingerprint(traced) -> str:
    """A hash of the graph's ops, tensor shapes and dtypes, and its wiring."""
    h = hashlib.sha256()
    for node in traced.graph.nodes:
        val = node.meta.get("val")
        leaves = val if isinstance(val, (list, tuple)) else [val]
        shapes = [(tuple(v.shape), str(v.dtype)) for v in leaves if isinstance(v, torch.Tensor)]
        args = [a.name for a in node.all_input_nodes]
        h.update(repr((node.op, str(node.target), shapes, args)).encode())
    return h.hexdigest()[:32]
