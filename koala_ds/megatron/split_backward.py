"""Split backward for any torch module: input gradients now (I), weight gradients later (W).

I runs the autograd engine from the stage output to the stage input only, keeping the graph,
and records the gradient that reaches each *boundary node*: a node on the input path that a
parameter feeds into. W later starts the engine at those boundary nodes, with the recorded
gradients, restricted to the parameters (so the input-side work is not repeated, and
parameter gradients accumulate through the ordinary AccumulateGrad nodes: `.grad`, hooks and
Megatron's DDP hooks behave as in a full backward). This is the method of
torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight`, rewritten so
that W goes through `torch.autograd.backward` and deallocated outputs are supported.

When a stage's input does not need a gradient (the first stage) there is nothing for I to
compute; W then runs the whole backward.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge


def _grad_node(t: torch.Tensor):
    """The autograd node of `t`: its grad_fn, or the AccumulateGrad node of a leaf."""
    if t.requires_grad and t.grad_fn is None:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return t.grad_fn


def _reverse_edges(roots) -> dict:
    edges: dict = collections.defaultdict(list)
    queue, seen = collections.deque(), set()
    for node in roots:
        if node is not None and node not in seen:
            seen.add(node)
            queue.append(node)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                if not edges[nxt]:
                    queue.append(nxt)
                edges[nxt].append(node)
    return edges


def _closure(roots, stop: set, edges: dict) -> tuple[set, set]:
    """Nodes reachable from `roots` along reverse edges (towards the output), not crossing `stop`;
    also the `stop` nodes met."""
    seen, met = set(), set()
    queue = collections.deque()
    for node in roots:
        if node is not None and node not in seen:
            seen.add(node)
            queue.append(node)
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt in seen or nxt is None:
                continue
            if nxt in stop:
                met.add(nxt)
                continue
            seen.add(nxt)
            queue.append(nxt)
    return seen, met


@dataclass
class _Group:
    params: set
    boundary: list
    grads: list = field(default_factory=list)


@dataclass
class DeferredWeightGrad:
    """What I leaves for W: boundary nodes with their gradients, or the whole backward."""

    params: list
    groups: list | None = None
    output: torch.Tensor | None = None  # full-backward fallback (first stage)
    output_grad: torch.Tensor | None = None
    deallocated: bool = False


def _run_engine(outputs, grads, inputs, keep_graph: bool, accumulate: bool):
    return Variable._execution_engine.run_backward(
        tensors=tuple(outputs), grad_tensors=tuple(grads), keep_graph=keep_graph, create_graph=False,
        inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=accumulate)


def param_nodes(params: list) -> dict:
    """{AccumulateGrad node: parameter} of the parameters that need gradients. Holding the nodes
    keeps them the parameters' accumulators, so one map serves every microbatch of a step."""
    out = {}
    for p in params:
        if p.requires_grad:
            node = _grad_node(p)
            if node is not None:
                out[node] = p
    return out


def backward_input(input_tensor, output_tensor: torch.Tensor, output_grad, params: list,
                   deallocated: bool, nodes: dict | None = None) -> tuple[torch.Tensor | None, DeferredWeightGrad]:
    """Gradient of the stage input only; returns it and the state W needs.

    `output_grad` None means `output_tensor` is the (scaled) loss. `deallocated` says the
    output's data was replaced by a placeholder (Megatron's deallocate_pipeline_outputs).
    `nodes`: `param_nodes(params)`, when the caller keeps it between calls."""
    if output_grad is None:
        output_grad = torch.ones_like(output_tensor)
    if input_tensor is None or not input_tensor.requires_grad or not output_tensor.requires_grad:
        return None, DeferredWeightGrad(params, output=output_tensor, output_grad=output_grad, deallocated=deallocated)
    out_node = _grad_node(output_tensor)
    in_node = _grad_node(input_tensor)
    node_param = param_nodes(params) if nodes is None else nodes
    edges = _reverse_edges([out_node])
    input_closure, _ = _closure([in_node], set(), edges)
    by_boundary: dict = {}
    for node in node_param:
        _, met = _closure([node], input_closure, edges)
        group = _Group({node}, sorted(met, key=id))
        for b in met:
            other = by_boundary.get(b)
            if other is not None and other is not group:
                other.params |= group.params
                other.boundary = sorted(set(other.boundary) | set(group.boundary), key=id)
                group = other
            by_boundary[b] = group
    groups = list({id(g): g for g in by_boundary.values()}.values())
    handles = []
    for group in groups:
        group.grads = [None] * len(group.boundary)
        for i, node in enumerate(group.boundary):
            def hook(grad_outputs, group=group, i=i):
                group.grads[i] = grad_outputs
            handles.append(node.register_prehook(hook))
    try:
        (dinput,) = _run_engine([output_tensor], [output_grad], [input_tensor], keep_graph=True, accumulate=False)
    finally:
        for h in handles:
            h.remove()
    output_tensor.detach_()  # free the output side of the graph that W does not need
    for group in groups:
        group.params = {node_param[n] for n in group.params}
    return dinput, DeferredWeightGrad(params, groups=groups)


def backward_weight(state: DeferredWeightGrad) -> None:
    """Accumulate the weight gradients left by `backward_input` into `.grad`."""
    if state.groups is None:
        if state.output is not None and state.output.requires_grad:
            _run_engine([state.output], [state.output_grad], [], keep_graph=False, accumulate=True)
        state.output = state.output_grad = None
        return
    groups = [g for g in state.groups if any(x is not None for x in g.grads)]
    for gi, group in enumerate(groups):
        edges, grads = [], []
        for node, grad_outputs in zip(group.boundary, group.grads):
            if grad_outputs is None:
                continue
            for i, g in enumerate(grad_outputs):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        handles = []
        if len(group.boundary) > 1:
            # A boundary node may lie below another one of the group: give it exactly its
            # recorded gradient, not that plus what flows in from above (no double counting).
            for node, saved in zip(group.boundary, group.grads):
                if saved is not None:
                    handles.append(node.register_prehook(lambda _g, saved=saved: saved))
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=list(group.params),
                                    retain_graph=gi < len(groups) - 1)
        finally:
            for h in handles:
                h.remove()
    state.groups = None
