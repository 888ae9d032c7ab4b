"""The generator's graph pass: walk the traced graph once, in order, and emit
the per-rank graph. Every placeholder of a parameter/buffer/constant becomes a
read of this rank's shard; every op reads its inputs converted to the specs the
plan chose (communication pass), runs on local shards with localised sizes and
global divisors (reshape localisation), and makes partial outputs whole."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.utils import _pytree as pytree

from automap.errors import AutomapError
from automap.generate import localize
from automap.generate.checkpoint import ORIGIN
from automap.generate.comm import Emitter
from automap.generate.ops import loss_denominator, mean_over_group, take_shard
from automap.generate.state import StateShard, local_bounds
from automap.sharding.collectives import (
    all_gather_dim,
    all_reduce_sum,
    gather_shard,
    identity_all_reduce_grad,
    split_dim,
)
from automap.sharding.spec import ShardingSpec
from automap.solve.fsdp import fused_gather
from automap.solve.gradient_buckets import deferrable
from automap.solve.signatures import VIEWS_OF_BASE, op_family, signature, written_args

_BIAS_OPS = {"linear": 2, "addmm": 0, "baddbmm": 0, "conv1d": 2, "conv2d": 2, "conv3d": 2,
             "conv_transpose1d": 2, "conv_transpose2d": 2, "conv_transpose3d": 2}
_WITHOUT_BIAS = {"addmm": torch.ops.aten.mm.default, "baddbmm": torch.ops.aten.bmm.default}


@dataclass
class GeneratedGraph:
    graph: fx.Graph
    attrs: dict  # attribute name -> object (process groups, higher-order-op bodies)
    shards: dict[str, StateShard] = field(default_factory=dict)  # by canonical name


def _is_replicated(spec: str) -> bool:
    return ShardingSpec.parse(spec).is_replicated


def _tensor_val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _dtype_bytes(node: fx.Node) -> int:
    return _tensor_val(node).dtype.itemsize


class _Pass:
    def __init__(self, traced, plan, groups, rank: int, device, local_inputs: bool) -> None:
        self.traced = traced
        self.plan = plan
        self.mesh = plan.mesh
        self.rank = rank
        self.local_inputs = local_inputs
        self.gm = traced.graph_module_on(device)
        self.out = GeneratedGraph(fx.Graph(), {})
        self.em = Emitter(self.out.graph, groups, self.out.attrs)
        self.env: dict[str, fx.Node] = {}
        # View node -> (its base, whether it read the base unconverted).
        self.view_base: dict[str, tuple[fx.Node, bool]] = {}
        # (activation, mesh axes) -> the one wrap whose backward all-reduces the
        # summed partial gradients of every reader (solve/shared_gradients.py).
        self.shared_grad: dict[tuple[str, tuple[int, ...]], fx.Node] = {}

    # Specs ---------------------------------------------------------------------------
    def spec_of(self, node: fx.Node, index: int = 0) -> str:
        """The planned spec of output ``index`` of ``node`` (replicated when unplanned)."""
        node_plan = self.plan.nodes.get(node.name)
        if node_plan is not None and len(node_plan.outputs) > index:
            return node_plan.outputs[index]
        val = node.meta.get("val")
        leaves = [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]
        return "R" * leaves[index].dim() if leaves else ""

    def convert(self, node: fx.Node, dst: str) -> fx.Node:
        return self.em.convert(self.env[node.name], self.spec_of(node), dst,
                               _tensor_val(node).shape, _dtype_bytes(node))

    # Walk ----------------------------------------------------------------------------
    def run(self) -> GeneratedGraph:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node.name] = self.placeholder(node)
            elif node.op == "get_attr":
                self.out.attrs[node.target] = getattr(self.gm, node.target)
                self.env[node.name] = self.out.graph.get_attr(node.target)
            elif node.op == "call_function":
                self.env[node.name] = self.call(node)
            elif node.op == "output":
                self.output(node)
            else:
                raise AutomapError(f"unexpected {node.op} node {node.name} in a traced graph")
            self.tag_origin(node.name)
        _drop_unused_local_ops(self.out.graph)
        return self.out

    def tag_origin(self, origin: str) -> None:
        """Mark the nodes just emitted as emitted for traced node ``origin``."""
        for new in reversed(self.out.graph.nodes):
            if ORIGIN in new.meta:
                break
            new.meta[ORIGIN] = origin

    def placeholder(self, node: fx.Node) -> fx.Node:
        graph, spec = self.out.graph, self.spec_of(node)
        state = self.traced.state_of(node.name)
        if state is None:  # a user input: every rank gets the global batch unless local
            value = graph.placeholder(node.name)
            value.meta = dict(node.meta)
            if self.local_inputs or _is_replicated(spec):
                return value
            bounds = local_bounds(spec, _tensor_val(node).shape, self.mesh, self.rank)
            return self.em.call(take_shard, value, bounds, name=f"{node.name}_shard")
        # Tied names are one tensor: all read the first name's shard.
        owner = state
        if state.tied and state.canonical != state.name:
            owner = self.traced.parameters.get(state.canonical) or self.traced.buffers.get(
                state.canonical) or state
        owner_spec = self.plan.nodes[owner.node].outputs[0]
        self.out.shards.setdefault(owner.name, StateShard(owner.name, owner.kind, owner_spec,
                                                          tuple(owner.shape)))
        value = graph.get_attr(owner.name)
        return self.em.convert(value, owner_spec, spec, state.shape, state.dtype.itemsize)

    def call(self, node: fx.Node) -> fx.Node:
        node_plan = self.plan.nodes.get(node.name)
        family = op_family(node)
        if node_plan is None:  # no tensor result (metadata asserts): run on local values
            return self.out.graph.node_copy(node, lambda n: self.env[n.name])
        if family == "getitem":
            producer, index = node.args
            value = self.em.call(operator.getitem, self.env[producer.name], index, name=node.name)
            return self.em.convert(value, self.spec_of(producer, index), node_plan.inputs[0],
                                   _tensor_val(node).shape, _dtype_bytes(node))
        args, kwargs = self.inputs(node, node_plan)
        if family in VIEWS_OF_BASE and isinstance(node.args[0], fx.Node):
            self.view_base[node.name] = (node.args[0], args[0] is self.env[node.args[0].name])
        self.check_in_place(node, args, kwargs)
        partial = list(node_plan.partial_axes)
        bias = None
        if node_plan.kind == "view" or family in ("expand", "unflatten"):
            args = localize.local_sizes(family, args, node, node_plan.outputs[0], self.mesh)
        scatter_dim = node_plan.scatter_dim
        if family == "scaled_dot_product_attention":
            args, kwargs = localize.causal_attention(node, args, kwargs, node_plan)
        rewritten = localize.rewrite(self.em, node, family, args, kwargs, node_plan, self.rank)
        if rewritten is not None:
            value, partial, scatter_dim = rewritten
        elif partial and family == "embedding":
            value = localize.vocab_parallel(self.em, args, kwargs, node_plan.inputs[0],
                                            node.args[0], self.rank)
        elif partial and family == "mean":
            value = localize.mean_as_partial_sum(self.em, node, args, kwargs)
        elif partial and localize.is_mean_loss(family, args, kwargs):
            value = localize.loss_as_partial_sum(self.em, node.target, family, args, kwargs,
                                                 partial)
        else:
            target = node.target
            if partial and _bias_of(node, family) is not None:
                # A bias is added once, to the whole sum, not on every rank.
                pos = _BIAS_OPS[family]
                bias, args = args[pos], list(args)
                if family in _WITHOUT_BIAS:
                    if any(kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
                        raise AutomapError(f"{node.name}: {family} with beta/alpha is not "
                                           "supported with a split contraction")
                    target, args, kwargs = _WITHOUT_BIAS[family], args[1:3], {}
                else:
                    args[pos] = None
            value = self.em.call(target, *args, name=node.name, **kwargs)
        if node_plan.kind == "source" and not _is_replicated(node_plan.outputs[0]):
            bounds = local_bounds(node_plan.outputs[0], _tensor_val(node).shape, self.mesh,
                                  self.rank)
            value = self.em.call(take_shard, value, bounds)
        if partial and not isinstance(node.meta.get("val"), torch.Tensor):
            raise AutomapError(f"{node.name}: partial sums of a multi-output op")
        value = self.em.reduce_partial(value, partial, scatter_dim)
        if bias is not None:
            value = self.add_bias(node, family, value, bias, partial, scatter_dim)
        return value

    def inputs(self, node: fx.Node, node_plan) -> tuple[tuple, dict]:
        """The node's arguments with every tensor converted to its planned spec (and
        wrapped for the backward all-reduce of a partial gradient)."""
        sig = signature(node)
        refs = [r for r, _ in sig.inputs] if sig is not None else None
        if refs is None:
            refs = [a.name for a in pytree.tree_leaves((node.args, node.kwargs))
                    if _tensor_val(a) is not None]
        source = node_plan.kind == "source"
        position = 0

        def local(a):
            nonlocal position
            if not isinstance(a, fx.Node):
                return a
            if _tensor_val(a) is None or source:
                return self.env[a.name]  # sources read only dtype/device from tensors
            if position < len(refs) and refs[position] == a.name:
                k, position = position, position + 1
                grads = node_plan.grad_reduce_axes
                axes = grads[k] if k < len(grads) else []
                fused = self.gather_parameter(a, node_plan.inputs[k], axes)
                if fused is not None:
                    return fused
                value = self.convert(a, node_plan.inputs[k])
                return self.reduce_grad(a, value, axes)
            return self.convert(a, "R" * _tensor_val(a).dim())

        args, kwargs = pytree.tree_map_only(fx.Node, local, (node.args, node.kwargs))
        return tuple(args), dict(kwargs)

    def reduce_grad(self, source: fx.Node, value: fx.Node, axes) -> fx.Node:
        """``value`` (``source`` as a node reads it) wrapped so that its gradient is
        all-reduced over ``axes``; readers of a tensor as produced (or stored: a
        parameter) share one wrap, so their partial gradients are summed before
        one all-reduce."""
        key = (source.name, tuple(axes))
        if not axes or value is not self.env[source.name]:
            return self.em.reduce_grad(value, axes)
        if key not in self.shared_grad:
            self.shared_grad[key] = self.em.reduce_grad(value, axes)
        return self.shared_grad[key]

    def gather_parameter(self, param: fx.Node, dst: str, grad_axes) -> fx.Node | None:
        """A trainable parameter stored split over axes its use reduces the gradient
        over (sharded data parallelism, ``automap.solve.fsdp``): gathered by fused
        ops whose backward reduce-scatters the gradient into the shard, the
        gradient axes not gathered all-reduced on the shard; None where the rule
        does not apply (the conversion and ``reduce_grad`` run)."""
        state = self.traced.state_of(param.name)
        if state is None or state.kind != "parameter" or not state.requires_grad:
            return None
        path = fused_gather(self.mesh, self.spec_of(param), dst, list(_tensor_val(param).shape),
                            _dtype_bytes(param), grad_axes)
        if path is None:
            return None
        gathered = {step.axis for step in path.steps}
        x = self.em.reduce_grad(self.env[param.name],
                                [a for a in grad_axes if a not in gathered])
        for step in path.steps:
            op = gather_shard if step.axis in grad_axes else all_gather_dim
            x = self.em.call(op, x, step.dim, self.em.group((step.axis,)))
        return x

    def check_in_place(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """An in-place op must mutate the tensor itself, not a converted copy, when the
        tensor is state (batch-norm statistics) or read again later."""
        for old in written_args(node):
            i = next((j for j, a in enumerate(node.args) if a is old), None)
            if i is not None:
                new = args[i] if i < len(args) else None
            else:
                key = next((k for k, a in node.kwargs.items() if a is old), None)
                new = kwargs.get(key)
            if new is self.env[old.name]:
                self.check_written_view(node, old)
                continue
            if self.traced.state_of(old.name) is not None or len(old.users) > 1:
                raise AutomapError(
                    f"{node.name} ({op_family(node)}) writes into {old.name}, but the plan "
                    f"gives {old.name} another layout there, so the write would be lost; the "
                    "plan must keep an in-place op's mutated input in its producer's spec")

    def check_written_view(self, node: fx.Node, view: fx.Node) -> None:
        """An in-place op writing into a view (``shifted[:, 1:] = ids[:, :-1]``)
        writes into the view's base only where each view on the way read its
        base as it is, not a converted copy."""
        while view.name in self.view_base:
            base, direct = self.view_base[view.name]
            if not direct:
                raise AutomapError(
                    f"{node.name} ({op_family(node)}) writes into {view.name}, a view of "
                    f"{base.name}, but the plan converts {base.name} on the way, so the "
                    "write would be lost; the plan must keep a written view in its base's "
                    "spec")
            view = base

    def add_bias(self, node, family, value, bias, partial, scatter_dim) -> fx.Node:
        out_shape = list(_tensor_val(node).shape)
        bias_shape = list(_tensor_val(_bias_of(node, family)).shape)
        conv = family.startswith("conv")
        if scatter_dim is not None:
            # The output is split along scatter_dim over the partial axes: so is the
            # bias's share where the bias has that dim.
            if conv:
                bias_dim = 0 if scatter_dim == 1 else None
            else:
                d = scatter_dim - (len(out_shape) - len(bias_shape))
                bias_dim = d if d >= 0 and bias_shape[d] == out_shape[scatter_dim] else None
            # Where the bias is broadcast along scatter_dim, its gradient is partial:
            # the plan's grad_reduce_axes reduce it (the wrap in inputs()).
            if bias_dim is not None:
                bias = self.em.call(split_dim, bias, bias_dim, self.em.group(partial))
        if conv:
            bias = self.em.call(torch.ops.aten.view.default, bias,
                                [-1] + [1] * (len(out_shape) - 2))
        return self.em.call(torch.ops.aten.add.Tensor, value, bias, name=f"{node.name}_bias")

    def output(self, node: fx.Node) -> None:
        specs = self.traced.exported.graph_signature.output_specs
        user = []
        for out_spec, value in zip(specs, pytree.tree_leaves(node.args[0])):
            if out_spec.kind.name == "USER_OUTPUT":
                if isinstance(value, fx.Node) and _tensor_val(value) is not None:
                    user.append(self.convert(value, "R" * _tensor_val(value).dim()))
                else:
                    user.append(self.env[value.name] if isinstance(value, fx.Node) else value)
            elif out_spec.kind.name == "BUFFER_MUTATION":
                name = _strip(out_spec.target)
                shard = self.out.shards[name]
                new = self.em.convert(self.env[value.name], self.spec_of(value), shard.spec,
                                      shard.global_shape, _dtype_bytes(value))
                self.em.call(torch.ops.aten.copy_.default, self.out.graph.get_attr(name), new)
            else:
                raise AutomapError(f"unsupported graph output kind {out_spec.kind.name}")
        self.out.graph.output(tuple(user))


#: Local, deterministic helpers the generator emits; unused, they can go.
_LOCAL_HELPERS = (take_shard, split_dim)


def _drop_unused_local_ops(graph: fx.Graph) -> None:
    """Erase the nodes whose results nothing reads and whose running has no effect: aten
    ops that write nothing and draw no random numbers, local slicing helpers, and
    metadata asserts on tensors that only asserts read. The constant causal mask is
    one, once attention runs the causal kernel without it."""
    changed = True
    while changed:
        changed = False
        for node in reversed(graph.nodes):
            if node.op == "call_function" and (_unused(node) or _lone_assert(node)):
                graph.erase_node(node)
                changed = True


def _unused(node: fx.Node) -> bool:
    if node.users:
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        # Writes, asserts and random draws have effects beyond their result.
        return not (target._schema.is_mutable or not target._schema.returns
                    or node.is_impure() or torch.Tag.nondeterministic_seeded in target.tags)
    return target in _LOCAL_HELPERS


def _lone_assert(node: fx.Node) -> bool:
    """A metadata assert on a tensor that nothing but asserts reads."""
    if node.target is not torch.ops.aten._assert_tensor_metadata.default:
        return False
    checked = node.args[0]
    return isinstance(checked, fx.Node) and all(
        u.target is torch.ops.aten._assert_tensor_metadata.default for u in checked.users)


def _bias_of(node: fx.Node, family: str) -> fx.Node | None:
    """The additive (bias) tensor argument of a linear/addmm/baddbmm/conv node."""
    pos = _BIAS_OPS.get(family)
    if pos is None or len(node.args) <= pos:
        return None
    return node.args[pos] if _tensor_val(node.args[pos]) is not None else None


def _strip(target: str) -> str:
    from automap.trace.tracing import _strip_inner

    return _strip_inner(target)


def fuse_mean_losses(out: GeneratedGraph) -> None:
    """A mean-reduced loss over a split batch, emitted as this rank's sum over
    the global count, then made whole (``all_reduce_sum(div(total,
    loss_denominator(..., g)), g)``), becomes one all-reduce of the sums and
    the counts together (``ops.mean_over_group``): the forward waits for one
    collective, not two, on every step."""
    for node in list(out.graph.nodes):
        if node.op != "call_function" or node.target is not all_reduce_sum:
            continue
        div = node.args[0]
        if not (isinstance(div, fx.Node) and div.target is torch.ops.aten.div.Tensor
                and len(div.users) == 1 and isinstance(div.args[1], fx.Node)):
            continue
        denominator = div.args[1]
        if denominator.target is not loss_denominator or len(denominator.users) != 1 \
                or denominator.args[3] is not node.args[1]:
            continue
        target, weight, ignore_index, group = denominator.args
        with out.graph.inserting_before(node):
            fused = out.graph.call_function(
                mean_over_group, (div.args[0], target, weight, ignore_index, group))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        for dead in (node, div, denominator):
            out.graph.erase_node(dead)


def _state_only_components(out: GeneratedGraph) -> list[list[fx.Node]]:
    """The connected parts of the graph computed from stored state alone: reads of
    parameters, buffers and constants, and the calls whose every input node is
    such a part (a cast of a weight, a position embedding's lookup of
    ``arange``). A collective reads a process group, which is not state, so
    none is inside. Each part in graph order."""
    inside: dict[fx.Node, fx.Node] = {}  # node -> a representative (union-find)

    def root(n: fx.Node) -> fx.Node:
        while inside[n] is not n:
            inside[n] = inside[inside[n]]
            n = inside[n]
        return n

    for node in out.graph.nodes:
        if node.op == "get_attr":
            if out.shards.get(node.target) is not None:
                inside[node] = node
        elif node.op == "call_function" and all(i in inside for i in node.all_input_nodes):
            inside[node] = node
            for i in node.all_input_nodes:
                inside[root(i)] = node
    parts: dict[fx.Node, list[fx.Node]] = {}
    for node in inside:
        parts.setdefault(root(node), []).append(node)
    return list(parts.values())


def _carries_gradient(node: fx.Node) -> bool:
    """False for a node known to make an integer or boolean tensor (from the
    traced value it carries; a node the pass made has none: True)."""
    val = _tensor_val(node)
    return val is None or val.is_floating_point() or val.is_complex()


def defer_parameter_gradient_sync(out: GeneratedGraph) -> list[tuple[str, tuple[int, ...]]]:
    """Take out of the graph the backward all-reduces of the gradients that reach
    parameters partial over the same mesh axes (data parallelism): they become
    the (name, axes) a ``GradientSync`` buckets, in order of first use.

    That holds for a part of the graph computed from stored state alone
    (``_state_only_components``: a parameter read as stored, its cast, a
    position embedding) whose every reader outside it all-reduces its gradient
    over one group: each rank computes the part alike, and a backward is linear
    in the gradient it is given, so the part's backward on this rank's partial
    gradient gives partial parameter gradients whose sum over the group is
    the parameters' gradient. The all-reduce then runs once per parameter in a
    bucket, overlapped with the rest of the backward, not once per reader and
    waited for in the middle of it (GPT-2's position embedding, added to a
    batch-split activation, was waited for at the end of every backward: 7 %
    of a 4-rank step on the vs_torch bench). Parts that share a parameter are
    deferred together or not at all."""
    graph = out.graph
    parts = []  # (the readers from outside, the parameters read, their one group or None)
    for nodes in _state_only_components(out):
        members = set(nodes)
        # An integer or boolean tensor (positions, a mask) carries no gradient.
        readers = [u for n in nodes if _carries_gradient(n) for u in n.users if u not in members]
        params = {n.target for n in nodes
                  if n.op == "get_attr" and out.shards[n.target].kind == "parameter"}
        if not readers or not params:  # nothing reads it, or no gradient to sum
            continue
        groups = {u.args[1].target for u in readers
                  if u.op == "call_function" and u.target is identity_all_reduce_grad}
        fits = len(groups) == 1 and all(
            u.op == "call_function" and u.target is identity_all_reduce_grad
            and u.args[0] in members for u in readers)
        parts.append((readers, params, groups.pop() if fits else None))
    first_use = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in first_use:
            first_use[node.target] = len(first_use)
    deferred = {}
    ok = deferrable([(params, group) for _, params, group in parts])
    for (readers, params, group), deferred_here in zip(parts, ok):
        if not deferred_here:
            continue
        for u in readers:
            u.replace_all_uses_with(u.args[0])
            graph.erase_node(u)
        for p in params:
            deferred[p] = out.attrs[group].axes
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target.startswith("group_") and not node.users:
            graph.erase_node(node)
    return sorted(deferred.items(), key=lambda item: first_use[item[0]])


def generate_graph(traced, plan, groups, rank: int, device, local_inputs: bool = False
                   ) -> GeneratedGraph:
    """This rank's graph of ``plan`` over ``traced`` (see the module docstring)."""
    return _Pass(traced, plan, groups, rank, device, local_inputs).run()
