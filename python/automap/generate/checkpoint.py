"""Checkpoint pass: the plan's activation-checkpoint blocks (the rotor
schedule's nested regions over linearized stages) become
``torch.utils.checkpoint.checkpoint(block, *inputs, use_reentrant=False)``
calls in the generated graph, nested where the schedule nests (non-reentrant
checkpoints nest; each keeps only its inputs for the backward, which runs the
region again). A region stashes the random generators' state for its
recomputation only where it draws random numbers (``draws_random``).

Every generated node carries the traced node it was emitted for
(``meta["automap_origin"]``), so a stage is the traced nodes linearization put
in it plus the collectives emitted for them: a recomputed region re-runs its
collectives, as the chain priced. A region's inputs are the tensors it reads
from outside (its first stage's input, parameters, masks); its outputs are the
tensors read after it. Process groups and nested regions are attributes of
the region's own GraphModule."""

from __future__ import annotations

import itertools
import operator

import torch
import torch.utils.checkpoint
from torch import fx

from automap.errors import AutomapError
from automap.solve.signatures import written_args

ORIGIN = "automap_origin"
_STAGE = "automap_stage"


def wrap_checkpoint_blocks(graph: fx.Graph, attrs: dict, stages: list[list[str]],
                           blocks: list[dict]) -> None:
    """Replace each block's nodes in ``graph`` by a checkpoint call;
    ``attrs`` (the module's non-state attributes) gains the regions."""
    if not blocks:
        return
    stage_of = {name: k for k, stage in enumerate(stages) for name in stage}
    _hoist_get_attrs(graph)
    for node in graph.nodes:
        node.meta[_STAGE] = stage_of.get(node.meta.get(ORIGIN)) if node.op == "call_function" \
            else None
    counter = itertools.count()
    for block in blocks:
        _wrap(graph, attrs, block, counter)
    # Nested regions belong to their parent region's module, not to this one.
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users and node.target.startswith("checkpoint_"):
            graph.erase_node(node)
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    for name in [a for a in attrs if a.startswith("checkpoint_") and a not in used]:
        del attrs[name]
    graph.lint()


def _hoist_get_attrs(graph: fx.Graph) -> None:
    """Attribute reads first: they belong to no stage and every region can read them."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node in list(graph.nodes):
        if node.op == "get_attr" and node is not first:
            first.prepend(node)


def _wrap(graph: fx.Graph, attrs: dict, block: dict, counter) -> None:
    for child in block.get("children", []):
        _wrap(graph, attrs, child, counter)
    lo, hi = block["start_stage"], block["end_stage"]
    region = [n for n in graph.nodes if n.meta.get(_STAGE) is not None
              and lo <= n.meta[_STAGE] <= hi]
    if not region:
        return
    inside = set(region)
    inputs: list[fx.Node] = []
    copied: list[fx.Node] = []  # reads of process groups and nested regions
    for node in region:
        for arg in node.all_input_nodes:
            if arg in inside or arg in inputs or arg in copied:
                continue
            if arg.op == "get_attr" and arg.target in attrs \
                    and not isinstance(attrs[arg.target], torch.Tensor):
                copied.append(arg)
            else:
                inputs.append(arg)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    # State the region writes (batch-norm statistics and counters) must change
    # once per step, not again on recomputation, and checkpoint refuses saved
    # inputs modified after the forward: the region gets an untouched copy,
    # writes its own copy of that, and the call copies the result back.
    written = list(dict.fromkeys(a for n in region for a in written_args(n, attrs)
                                 if a not in inside))

    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = sub.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for arg in copied:
        env[arg] = sub.get_attr(arg.target)
    for arg in written:
        env[arg] = sub.call_function(torch.ops.aten.clone.default, (env[arg],),
                                     name=f"{arg.name}_local")
    for node in region:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in [*outputs, *written]))
    index = next(counter)
    name = f"checkpoint_{index}_stages_{lo}_{hi}"
    attrs[name] = fx.GraphModule({a.target: attrs[a.target] for a in copied}, sub,
                                 class_name=f"CheckpointBlock{index}")

    # The call goes where the region began; its outputs replace the region's.
    _check_contiguous(region, inside)
    with graph.inserting_before(region[0]):
        fn = graph.get_attr(name)
        args = [graph.call_function(torch.ops.aten.clone.default, (a,), name=f"{a.name}_copy")
                if a in written else a for a in inputs]
        call = graph.call_function(torch.utils.checkpoint.checkpoint, (fn, *args),
                                   {"use_reentrant": False,
                                    "preserve_rng_state": draws_random(region)},
                                   name=f"block_{index}")
        call.meta[_STAGE] = lo
        fn.meta[_STAGE] = None
        results = []
        for i, node in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, i), name=f"{node.name}_ckpt")
            item.meta = {k: v for k, v in node.meta.items() if k != _STAGE}
            item.meta[_STAGE] = lo
            results.append(item)
        for i, state in enumerate(written, start=len(outputs)):
            item = graph.call_function(operator.getitem, (call, i))
            write = graph.call_function(torch.ops.aten.copy_.default, (state, item))
            item.meta[_STAGE] = write.meta[_STAGE] = lo
    for node, item in zip(outputs, results):
        for user in list(node.users):
            if user not in inside:
                user.replace_input_with(node, item)
    for node in reversed(region):
        graph.erase_node(node)


#: Modules whose functions the generator emits and that draw no random numbers
#: unless a random op is among their arguments (``ops.sharded_dropout(op, ...)``).
_GENERATED_CALLS = ("automap.sharding.collectives", "automap.generate.ops")


def draws_random(nodes) -> bool:
    """Whether running ``nodes`` may draw from a random generator: only then must
    a region's recomputation replay the generator, whose state stashed costs
    5 KB of CPU memory from the region's forward to its recomputation (torch
    2.15's Mersenne Twister). Deterministic: aten and prims ops without the
    ``nondeterministic_seeded`` tag (dropout, ``rand``, attention, RNNs carry
    it), the generator's collectives and local ops not given such an op, a
    nested region that does not stash; anything else may draw (other
    libraries' custom ops, higher-order ops, unknown functions)."""
    return any(_draws_random(node) for node in nodes if node.op == "call_function")


def _random_op(value) -> bool:
    return isinstance(value, torch._ops.OpOverload) \
        and torch.Tag.nondeterministic_seeded in value.tags


def _draws_random(node: fx.Node) -> bool:
    target = node.target
    if target is torch.utils.checkpoint.checkpoint:
        return bool(node.kwargs.get("preserve_rng_state", True))
    if any(_random_op(v) for v in torch.utils._pytree.tree_leaves((node.args, node.kwargs))):
        return True  # the generator's random ops on shards, e.g. ops.sharded_dropout
    if isinstance(target, torch._ops.OpOverload):
        return _random_op(target) or target.namespace not in ("aten", "prims")
    return not (target is operator.getitem
                or getattr(target, "__module__", None) in _GENERATED_CALLS)


def _check_contiguous(region, inside) -> None:
    """The region must be contiguous: nothing between its nodes reads its outputs."""
    first, last = region[0], region[-1]
    node = first
    while node is not last:
        node = node.next
        if node not in inside and any(a in inside for a in node.all_input_nodes):
            raise AutomapError(
                f"checkpoint region {first.name}..{last.name} is not contiguous: {node.name} "
                "reads it from within; the plan's stages do not match this graph")
