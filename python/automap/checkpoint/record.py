"""The activation-checkpoint part of a Plan: the linearized stages (traced node
names), the nested checkpoint blocks the generator emits, and the rotor
schedule's predictions (recomputation time, memory timeline)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CheckpointPlan:
    stages: list[list[str]]
    #: Nested regions: {"start_stage", "end_stage", "children": [...]}.
    blocks: list[dict]
    activation_budget_bytes: int
    persistent_bytes: int
    predicted_activation_peak_bytes: int
    recompute_s: float
    #: The memory budget of the intra-op ILP whose solution this schedule
    #: checkpoints (the two-stage search's ladder rung; None: unconstrained).
    ilp_budget_bytes: float | None
    #: (op, stage, bytes live while it runs) per op of the schedule.
    timeline: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    def from_schedule(cls, chain, schedule, ilp_budget_bytes) -> CheckpointPlan:
        return cls(
            stages=[list(s) for s in chain.stages],
            blocks=[_block_dict(b) for b in schedule.blocks],
            activation_budget_bytes=int(schedule.budget_bytes),
            persistent_bytes=int(chain.persistent_bytes),
            predicted_activation_peak_bytes=int(schedule.peak_memory_bytes),
            recompute_s=float(schedule.recompute_time_s),
            ilp_budget_bytes=ilp_budget_bytes,
            timeline=[(op, k, int(m)) for (op, k), m in zip(schedule.ops,
                                                             schedule.op_memory_bytes)],
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> CheckpointPlan | None:
        if data is None:
            return None
        data = dict(data)
        data["timeline"] = [tuple(t) for t in data.get("timeline", [])]
        return cls(**data)

    def block_count(self) -> int:
        def count(blocks):
            return sum(1 + count(b["children"]) for b in blocks)
        return count(self.blocks)

    def describe(self, max_timeline_rows: int = 24) -> list[str]:
        """Lines for ``Plan.explain``: the blocks, then the memory timeline."""
        mib = 2**20
        blocks = self.block_count()
        memory = (f"activations peak {self.predicted_activation_peak_bytes / mib:.1f} MiB of "
                  f"{self.activation_budget_bytes / mib:.1f} MiB (besides "
                  f"{self.persistent_bytes / mib:.1f} MiB of parameters, gradients, optimizer "
                  f"state and inputs)"
                  + ("" if self.ilp_budget_bytes is None else
                     f"; sharding planned for {self.ilp_budget_bytes / mib:.1f} MiB"))
        if blocks == 0:
            return [f"activation checkpointing: none needed, every activation is kept; "
                    f"{memory}"]
        lines = [
            f"activation checkpointing: {len(self.stages)} stages, {blocks} checkpoint "
            f"block{'' if blocks == 1 else 's'}, recomputation {self.recompute_s * 1e3:.3f} ms; "
            f"{memory}"]

        def show(blocks, depth):
            for b in blocks:
                first = self.stages[b["start_stage"]][0]
                last = self.stages[b["end_stage"]][-1]
                lines.append(f"{'  ' * depth}  checkpoint stages {b['start_stage']}.."
                             f"{b['end_stage']} ({first} .. {last})")
                show(b["children"], depth + 1)
        show(self.blocks, 0)
        if self.timeline:
            lines.append("predicted memory timeline (activations live during each op):")
            step = max(1, len(self.timeline) // max_timeline_rows)
            peak = max(m for _, _, m in self.timeline) or 1
            for i in range(0, len(self.timeline), step):
                window = self.timeline[i:i + step]
                op, k, m = max(window, key=lambda t: t[2])
                bar = "#" * round(30 * m / peak)
                lines.append(f"  {i:5d} {op:18} stage {k:4d} {m / mib:9.2f} MiB {bar}")
        return lines


def _block_dict(block) -> dict:
    return {"start_stage": int(block.start_stage), "end_stage": int(block.end_stage),
            "children": [_block_dict(c) for c in block.children]}
