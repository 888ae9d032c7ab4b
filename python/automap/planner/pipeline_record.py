"""The pipeline part of a Plan (inter-op parallelism, issue 18): the mesh is cut
into stages of equal submeshes, each stage runs a contiguous range of the
traced graph's nodes on its submesh, and microbatches flow through the stages
under a schedule.

Every stage runs the same intra-op plan (the Plan's nodes and edges, made for
one microbatch on the submesh shape), restricted to its nodes, so a tensor that
crosses a stage boundary has the same spec on both sides: the rank at position
``p`` of stage ``k``'s submesh sends its local shard to the rank at position
``p`` of stage ``k + 1`` (and the gradient back), with no conversion.

Interleaved 1F1B (``schedule="interleaved"``, Megatron's virtual stages): the
node ranges are ``n * v`` chunks (``stages``, one record per chunk, in graph
order) on ``n`` submeshes, chunk ``j`` on submesh ``j mod n`` (its ``ranks``),
so each rank holds ``v = virtual_stages`` chunks; the last chunk sends nothing
and chunk ``n - 1`` sends to chunk ``n`` from the last submesh to the first.
Every other schedule has ``virtual_stages == 1``: one chunk per submesh."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class StageRecord:
    index: int
    #: The stage's nodes: the traced graph's computed nodes (not placeholders,
    #: not the output) from ``first_node`` through ``last_node``, in graph order.
    first_node: str
    last_node: str
    #: The stage's submesh ranks, row-major in ``PipelineRecord.submesh_shape``.
    ranks: tuple[int, ...]
    #: Per microbatch, on one rank of the stage.
    predicted_forward_s: float
    predicted_backward_s: float
    #: The stage's peak per rank with the schedule's in-flight microbatches
    #: (interleaved: the peak of the rank holding this chunk, all its chunks
    #: together; every chunk of a rank carries the same figure).
    predicted_peak_memory_bytes: float
    #: In a depth-reduced plan (estimates only), the traced block that stands
    #: for several real ones repeats: which repeat the stage starts and ends
    #: in (0 otherwise).
    first_repeat: int = 0
    last_repeat: int = 0
    #: The stage checkpoints its whole forward: per microbatch in flight only
    #: its input is kept, and the forward runs again before the backward
    #: (``predicted_backward_s`` includes it).
    recompute: bool = False
    #: The linear memory model's peak of the stage, where
    #: ``predicted_peak_memory_bytes`` is the simulated step's (the planner
    #: verified the plan; None: the model's is the prediction).
    modelled_peak_memory_bytes: float | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ranks"] = list(self.ranks)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> StageRecord:
        return cls(**{"first_repeat": 0, "last_repeat": 0, "recompute": False,
                      "modelled_peak_memory_bytes": None, **data,
                      "ranks": tuple(data["ranks"])})


@dataclass(frozen=True)
class PipelineRecord:
    #: The whole mesh the pipeline spans, as ``DeviceMesh.to_dict``.
    mesh: dict
    #: The shape of every stage's submesh (the Plan's mesh has this shape and
    #: stage 0's ranks; the node specs name its axes).
    submesh_shape: tuple[int, ...]
    microbatches: int
    schedule: str
    stages: tuple[StageRecord, ...]
    #: The schedule's predicted step (all microbatches, forward, backward and
    #: the optimizer step).
    predicted_step_s: float
    #: Seconds to send one microbatch's boundary activations from stage k to
    #: k + 1 (one entry per boundary).
    send_s: tuple[float, ...]
    #: The best intra-op-only plan's predicted step on the whole mesh, for
    #: comparison (None: not searched).
    intra_op_step_s: float | None = None
    #: Of ``predicted_step_s``: the gradient sync and optimizer step after the
    #: last microbatch (the slowest stage's), and the all-reduce of weights
    #: tied across stages.
    tail_s: float = 0.0
    tied_s: float = 0.0
    #: Chunks per rank (interleaved; 1 otherwise): ``stages`` holds
    #: ``stage_count * virtual_stages`` chunks, chunk ``j`` on submesh
    #: ``j mod stage_count``.
    virtual_stages: int = 1

    def to_dict(self) -> dict:
        return {
            "mesh": self.mesh,
            "submesh_shape": list(self.submesh_shape),
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "stages": [s.to_dict() for s in self.stages],
            "predicted_step_s": self.predicted_step_s,
            "send_s": list(self.send_s),
            "intra_op_step_s": self.intra_op_step_s,
            "tail_s": self.tail_s,
            "tied_s": self.tied_s,
            "virtual_stages": self.virtual_stages,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> PipelineRecord | None:
        if data is None:
            return None
        return cls(
            mesh=dict(data["mesh"]),
            submesh_shape=tuple(data["submesh_shape"]),
            microbatches=int(data["microbatches"]),
            schedule=str(data["schedule"]),
            stages=tuple(StageRecord.from_dict(s) for s in data["stages"]),
            predicted_step_s=float(data["predicted_step_s"]),
            send_s=tuple(float(s) for s in data["send_s"]),
            intra_op_step_s=(None if data.get("intra_op_step_s") is None
                             else float(data["intra_op_step_s"])),
            tail_s=float(data.get("tail_s", 0.0)),
            tied_s=float(data.get("tied_s", 0.0)),
            virtual_stages=data.get("virtual_stages", 1),
        )

    @property
    def stage_count(self) -> int:
        """The submeshes (pipeline ranks): the chunks over ``virtual_stages``."""
        return len(self.stages) // max(1, int(self.virtual_stages))

    @property
    def chunk_count(self) -> int:
        return len(self.stages)

    def stage_of_rank(self, rank: int) -> StageRecord:
        """The first chunk ``rank`` holds (its only one unless interleaved)."""
        return self.chunks_of_rank(rank)[0]

    def chunks_of_rank(self, rank: int) -> list[StageRecord]:
        found = [stage for stage in self.stages if rank in stage.ranks]
        if not found:
            raise KeyError(rank)
        return found
