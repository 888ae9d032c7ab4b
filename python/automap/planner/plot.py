"""Pictures of a Plan (matplotlib, an optional extra: ``pip install automap[plot]``).

``plot_plan``: the graph's nodes in order, coloured by what each mesh axis does
to the node's output (splits the batch, splits another dim, leaves partial sums,
or nothing), the layout conversions marked at the node that receives them, the
checkpoint blocks shaded, and each node's predicted time below.

``plot_memory``: the simulated step's live bytes per rank by category over the
step (``Plan.memory_timeline``), the phases, the budget line, and optionally a
measured curve (``MeasuredMemory``).

matplotlib is imported inside the functions, so automap runs without it; the
figures are drawn on ``matplotlib.figure.Figure`` (no pyplot state, no display)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from automap.errors import AutomapError, InvalidArgumentError
from automap.trace.allocator_events import allocation_events, total_before

#: Nodes that are not computation (graph inputs, parameters, the output).
_NOT_COMPUTED = ("parameter", "input", "output", "buffer", "constant")
_PHASE_COLOURS = {"forward": "#e8f1fb", "backward": "#fbeee6", "optimizer": "#eef7e9"}
_REPLICATED = "replicated"
#: Legend names of ``automap.generate.simulate.CATEGORIES`` that need words.
_CATEGORY_NAMES = {"activations": "activations (kept for the backward)",
                   "backward": "backward (activation gradients, temporaries)",
                   "communication": "communication buffers",
                   "optimizer_step": "optimizer step temporaries",
                   "workspace": "kernel scratch",
                   "library_workspaces": "cuBLAS/cuBLASLt workspaces",
                   "reserve": "reserve (what the simulated step does not see)"}


class PlotDependencyError(AutomapError, ImportError):
    """matplotlib, which draws the pictures, is not installed."""


@dataclass(frozen=True)
class MeasuredMemory:
    """A measured memory curve of one rank's training step, to compare with the
    prediction: ``at`` the fraction of the step (0 to 1, increasing) at which
    ``bytes`` (live tensor bytes on the rank) were read. The prediction's x axis
    is the fraction of the step's allocations and frees before a point, so a
    curve from the allocator's own events (``from_profiler``) lines up with it
    roughly (the allocator sees some allocations the simulation does not, e.g.
    inside kernels, so its events run somewhat ahead); the heights compare
    exactly."""

    at: tuple[float, ...]
    bytes: tuple[float, ...]
    label: str = "measured"

    def __post_init__(self) -> None:
        if len(self.at) != len(self.bytes) or not self.at:
            raise InvalidArgumentError(
                f"measured: at ({len(self.at)} values) and bytes ({len(self.bytes)} values) "
                f"must be equally long and not empty")
        for name, values, low, high in (("at", self.at, 0.0, 1.0),
                                        ("bytes", self.bytes, 0.0, math.inf)):
            bad = [v for v in values if not (isinstance(v, (int, float)) and low <= v <= high
                                            and math.isfinite(v))]
            if bad:
                raise InvalidArgumentError(
                    f"measured.{name} holds {bad[0]!r}; values must be finite numbers from "
                    f"{low} to {high}")
        if any(b < a for a, b in zip(self.at, self.at[1:])):
            raise InvalidArgumentError("measured.at must not decrease (fractions of the step "
                                       "in order)")

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[float, float]], label: str = "measured"
                   ) -> MeasuredMemory:
        """From (fraction of the step, live bytes) pairs."""
        pairs = list(pairs)
        return cls(tuple(float(a) for a, _ in pairs), tuple(float(b) for _, b in pairs),
                   label)

    @classmethod
    def from_profiler(cls, prof, base_bytes: float = 0.0, device: str = "cpu",
                      label: str = "measured (allocator)") -> MeasuredMemory:
        """From a ``torch.profiler.profile(profile_memory=True)`` around exactly one
        training step: the allocator's running total after each of its allocation
        and free events on ``device``, less the total before the first, plus
        ``base_bytes`` (what was live when the step began: parameters, optimizer
        state, inputs), at the event's index over all of the step's events."""
        events = allocation_events(prof.profiler.kineto_results, device)
        if not events:
            raise InvalidArgumentError(
                f"prof holds no {device} memory events; profile one step with "
                f"torch.profiler.profile(profile_memory=True)")
        start = total_before(events)
        count = max(1, len(events) - 1)
        return cls(tuple(i / count for i in range(len(events))),
                   tuple(float(max(0, n.typed[1].total_allocated - start) + base_bytes)
                         for n in events), label)


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotDependencyError(
            "automap's pictures need matplotlib, which is not installed: "
            "pip install automap[plot] (or pip install matplotlib)") from None
    return Figure


def _check_path(Figure, path: str) -> None:
    """A file name whose suffix matplotlib writes (png, svg, pdf ...)."""
    import os

    suffix = os.path.splitext(str(path))[1].lstrip(".").lower()
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise InvalidArgumentError(
            f"path {path!r} ends in {suffix or 'no suffix'!r}; pictures are written as one of "
            f"{', '.join(sorted(formats))} (by the file's suffix)")


def _unit(n: float) -> tuple[float, str]:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return scale, unit
    return 1, "B"


# The plan's graph ---------------------------------------------------------------------
def sharding_kind(node, ndim: int) -> str:
    """What each mesh axis does to ``node``'s (first) output, e.g. "axis 0: batch,
    axis 1: model" ("batch": splits dim 0, "model": splits another dim, "partial":
    partial sums reduced by the node), or "replicated"."""
    from automap.sharding.spec import ShardingSpec

    roles = [""] * ndim
    if node.outputs and node.outputs[0]:
        for dim, axes in enumerate(ShardingSpec.parse(node.outputs[0]).dims):
            for axis in axes or ():
                roles[axis] = "batch" if dim == 0 else "model"
    for axis in node.partial_axes:
        roles[axis] = roles[axis] or "partial"
    parts = [f"axis {a}: {r}" for a, r in enumerate(roles) if r]
    return ", ".join(parts) if parts else _REPLICATED


def _module_group(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) if path else "(top)"


def _groups(nodes, max_groups: int = 24) -> list[tuple[str, int, int]]:
    """Runs of consecutive nodes in one module (the deepest path level that
    still gives at most ``max_groups`` runs): (name, first index, last index)."""
    best: list[tuple[str, int, int]] = []
    for depth in range(1, 6):
        runs: list[tuple[str, int, int]] = []
        for i, n in enumerate(nodes):
            name = _module_group(n.module_path, depth)
            if runs and runs[-1][0] == name:
                runs[-1] = (name, runs[-1][1], i)
            else:
                runs.append((name, i, i))
        if best and len(runs) > max_groups:
            break
        best = runs
    return best


def plot_plan(plan, path: str, title: str | None = None) -> str:
    """Draw ``plan``'s graph to ``path`` (PNG, SVG or PDF by suffix); returns ``path``."""
    Figure = _figure_class()
    _check_path(Figure, path)
    from matplotlib.patches import Patch

    nodes = [n for n in plan.nodes.values() if n.kind not in _NOT_COMPUTED]
    if not nodes:
        raise InvalidArgumentError("plan has no computed nodes to draw")
    position = {n.name: i for i, n in enumerate(nodes)}
    kinds = [sharding_kind(n, plan.mesh.ndim) for n in nodes]
    order = sorted(set(kinds), key=lambda k: (k != _REPLICATED, -kinds.count(k), k))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
               "#bcbd22", "#d62728", "#7f7f7f"]
    colour = {k: ("#c8c8c8" if k == _REPLICATED else palette[(i - 1) % len(palette)])
              for i, k in enumerate(order)}

    fig = Figure(figsize=(max(12.0, min(18.0, len(nodes) * 0.09)), 6.4), layout="constrained")
    strip, times = fig.subplots(2, 1, sharex=True, height_ratios=[1.15, 2.0])
    x = range(len(nodes))

    # Top: checkpoint blocks, the sharding strip, conversions.
    strip.bar(x, [1.0] * len(nodes), width=1.0, bottom=0.0, color=[colour[k] for k in kinds],
              edgecolor="none")
    if plan.checkpoint is not None:
        stages = plan.checkpoint.stages

        def shade(blocks, depth):
            for i, b in enumerate(blocks):
                members = [position[m] for s in stages[b["start_stage"]:b["end_stage"] + 1]
                           for m in s if m in position]
                if members:  # neighbours alternate in shade, so each block shows
                    strip.add_patch(_rectangle(min(members) - 0.4, 1.05 + 0.22 * depth,
                                               max(members) - min(members) + 0.8, 0.18,
                                               alpha=0.55 if i % 2 else 0.3))
                shade(b["children"], depth + 1)
        shade(plan.checkpoint.blocks, 0)
    conversions = [e for e in plan.edges if e.steps and e.consumer in position]
    if conversions:
        strip.scatter([position[e.consumer] for e in conversions], [-0.22] * len(conversions),
                      marker="^", s=40, color="#d62728", zorder=3, clip_on=False)
    strip.set_ylim(-0.45, 1.75)
    strip.set_yticks([-0.22, 0.5, 1.14],
                     ["conversions", "output sharding", "checkpoint blocks"], fontsize=9)
    strip.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        strip.spines[side].set_visible(False)
    handles = [Patch(color=colour[k], label=k) for k in order]
    if plan.checkpoint is not None and plan.checkpoint.blocks:
        handles.append(_rectangle(0, 0, 1, 1,
                                  label="checkpoint block (recomputed in the backward)"))
    handles.append(strip.scatter([], [], marker="^", s=40, color="#d62728",
                                 label=f"layout conversion into the node ({len(conversions)})"))
    strip.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.05), fontsize=8,
                 title=f"output sharding per axis of mesh {tuple(plan.mesh.shape)}\n"
                       f"(batch: splits dim 0, model: another dim,\n"
                       f"partial: partial sums reduced by the node)",
                 title_fontsize=8, alignment="left", frameon=False)

    # Bottom: each node's predicted time by part, conversions into it included.
    ms = 1e3
    conversion_s = [0.0] * len(nodes)
    for e in conversions:
        conversion_s[position[e.consumer]] += e.cost_s
    compute = [n.compute_s * ms for n in nodes]
    comm = [(n.forward_comm_s + n.backward_comm_s) * ms for n in nodes]
    conv = [c * ms for c in conversion_s]
    times.bar(x, compute, width=0.85, color="#4c72b0", label="compute (forward + backward)")
    times.bar(x, comm, width=0.85, bottom=compute, color="#dd8452",
              label="the node's collectives")
    times.bar(x, conv, width=0.85, bottom=[a + b for a, b in zip(compute, comm)],
              color="#d62728", label="conversions into it")
    times.set_ylabel("predicted time per node (ms)")
    times.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    times.grid(axis="y", alpha=0.3)
    groups = _groups(nodes)
    for _, first, _ in groups[1:]:
        for ax in (strip, times):
            ax.axvline(first - 0.5, color="#555555", linewidth=0.5, alpha=0.35)
    wide = [g for g in groups if g[2] - g[1] + 1 >= max(3, len(nodes) // 40)]
    times.set_xticks([(a + b) / 2 for _, a, b in wide], [g for g, _, _ in wide],
                     rotation=35, ha="right", fontsize=8)
    times.set_xlim(-0.5, len(nodes) - 0.5)
    times.set_xlabel(f"the {len(nodes)} computed nodes in graph order, by module "
                     f"(parameters and inputs left out)")
    budget = ("no budget" if plan.memory_budget_bytes is None
              else f"budget {_format(plan.memory_budget_bytes)}"
              + (", binding" if plan.memory_binding else ""))
    blocks = plan.checkpoint.block_count() if plan.checkpoint is not None else 0
    if blocks:
        budget += f"; {blocks} checkpoint block{'' if blocks == 1 else 's'}"
    fig.suptitle(title or (
        f"automap plan on mesh {tuple(plan.mesh.shape)}: step {plan.predicted_step_s * ms:.3f} "
        f"ms predicted, peak {_format(plan.predicted_peak_memory_bytes)} per rank ({budget})"),
        fontsize=11)
    fig.savefig(path, dpi=110)
    return path


def _rectangle(x0, y0, width, height, label=None, alpha=0.35):
    from matplotlib.patches import Rectangle

    return Rectangle((x0, y0), width, height, facecolor="#6a3d9a", alpha=alpha,
                     edgecolor="#6a3d9a", linewidth=0.8, label=label)


def _format(n: float) -> str:
    scale, unit = _unit(n)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} B"


# Memory over the step -----------------------------------------------------------------
def plot_memory(plan, path: str, measured: MeasuredMemory | Sequence | None = None,
                title: str | None = None) -> str:
    """Draw ``plan``'s predicted memory per rank over the step to ``path``, with a
    ``MeasuredMemory`` (or (fraction, bytes) pairs) overlaid; returns ``path``."""
    timeline = plan.memory_timeline
    if not timeline or not timeline.get("samples"):
        raise InvalidArgumentError(
            "plan has no memory_timeline: it was not verified by a simulated step "
            "(plan with verify=True, without reduce_depth)")
    if measured is not None and not isinstance(measured, MeasuredMemory):
        measured = MeasuredMemory.from_pairs(measured)
    Figure = _figure_class()
    _check_path(Figure, path)

    categories = timeline["categories"]
    samples = timeline["samples"]
    totals = [sum(s["bytes"]) for s in samples]
    top = max([*totals, plan.memory_budget_bytes or 0,
               *(measured.bytes if measured is not None else [])])
    scale, unit = _unit(top)
    # Each sample holds from its point to the next; the first from the step's start.
    at = [0.0] + [s["at"] for s in samples[1:]] + [1.0]
    drawn = [*samples, samples[-1]]
    used = [i for i, _ in enumerate(categories) if any(s["bytes"][i] for s in samples)]
    fig = Figure(figsize=(12.0, 5.6), layout="constrained")
    ax = fig.subplots()
    # Phases as background bands, labelled at the top.
    spans: list[list] = []
    for x, s in zip(at, samples):
        if not spans or spans[-1][0] != s["phase"]:
            spans.append([s["phase"], x, x])
    for i, (phase, a, _) in enumerate(spans):
        b = spans[i + 1][1] if i + 1 < len(spans) else 1.0
        ax.axvspan(a, b, color=_PHASE_COLOURS.get(phase, "#f4f4f4"), zorder=0)
        ax.text((a + b) / 2, 1.01, phase, transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=9, color="#444444")
    colours = ["#4c72b0", "#8172b3", "#937860", "#da8bc3", "#55a868", "#dd8452", "#c44e52",
               "#64b5cd", "#ccb974", "#8c8c8c", "#b0b0b0"]
    ax.stackplot(at, *[[s["bytes"][i] / scale for s in drawn] for i in used],
                 labels=[_CATEGORY_NAMES.get(categories[i], categories[i].replace("_", " "))
                         for i in used],
                 colors=[colours[i % len(colours)] for i in used], step="post", alpha=0.9,
                 zorder=2)
    peak_i = max(range(len(samples)), key=lambda i: totals[i])
    peak_x = (at[peak_i] + at[peak_i + 1]) / 2
    ax.plot([peak_x], [totals[peak_i] / scale], marker="v", color="black", zorder=4,
            linestyle="none",
            label=f"predicted peak {_format(totals[peak_i])} ({samples[peak_i]['phase']}, "
                  f"{samples[peak_i]['node']})")
    if plan.memory_budget_bytes is not None:
        ax.axhline(plan.memory_budget_bytes / scale, color="#d62728", linestyle="--",
                   linewidth=1.5, zorder=3,
                   label=f"memory budget {_format(plan.memory_budget_bytes)}")
    if measured is not None:
        ax.plot(measured.at, [b / scale for b in measured.bytes], color="black", linewidth=1.3,
                drawstyle="steps-post", zorder=5, label=measured.label)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, top / scale * 1.08)
    ax.set_xlabel("progress through one training step (fraction of the step's allocations "
                  "and frees)")
    ax.set_ylabel(f"live memory per rank ({unit})")
    ax.grid(axis="y", alpha=0.3, zorder=1)
    handles, labels = ax.get_legend_handles_labels()
    stacked = len(used)  # listed top of the stack first, as drawn
    order = [*reversed(range(stacked)), *range(stacked, len(handles))]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.suptitle(title or (
        f"predicted memory per rank over one step, mesh {tuple(plan.mesh.shape)} "
        f"(simulated on fake tensors, by category)"), fontsize=11)
    fig.savefig(path, dpi=110)
    return path
