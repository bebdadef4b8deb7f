"""The backward split into an input-gradient pass (B) and a weight-gradient pass (W), public autograd API only.

Zero-bubble schedules (``ethpipe.schedule``) send the input gradient as soon as it exists and compute
the weight gradients later. ``backward_input`` finds, in the micro-batch's autograd graph, every node
on a path to the stage input whose other inputs lead only to parameters (a matmul, the norm's scale,
a bias add: the *split nodes*); it runs ``torch.autograd.grad`` w.r.t. the stage input alone, with
``retain_graph=True`` and a pre-hook on each split node recording the gradient of its output. Autograd
then skips every computation that only a weight needs (a matmul's ``dW = X^T dY`` kernel included:
its output mask says so). ``backward_weight`` restarts each split node from its recorded gradient
(``torch.autograd.backward`` on its ``GradientEdge``s) with ``inputs=`` its own parameters: autograd
runs only the weight branch of that node and accumulates into ``.grad`` as a whole backward would (so
the gradient sync's post-accumulate hooks fire there). One call per split node, because starting
several at once would also push each node's gradient down its input path into the earlier nodes'
parameters, counting them twice.

Cost: B + W run exactly the kernels of one whole backward (tests/unit/test_split_backward.py counts
the matmuls). Not under activation recompute: ``torch.utils.checkpoint`` recomputes a layer's forward in
every autograd call that unpacks its saved tensors, so W, one call per split node, would recompute it
once per weight GEMM. The schedules therefore never split a recomputing stage (``schedule.zb_h1``). A
weight used by two split nodes of one micro-batch (a layer applied twice) cannot be split this way: such a
stage runs a whole backward in B and an empty W (correct, no overlap gained).
Between B and W the micro-batch's graph, saved activations included, stays alive: a split micro-batch is
in flight until its W (``schedule.max_in_flight``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightWork:
    """What one micro-batch's W needs: per split node, the parameters below it and its output gradients."""

    roots: list[tuple[Node, list[torch.Tensor], tuple[torch.Tensor | None, ...]]]


def _reaches(root: Node, targets: set[Node]) -> dict[Node, bool]:
    """For every node reachable from ``root``: whether one of ``targets`` is reachable from it (iterative:
    a deep stage's graph is deeper than Python's recursion limit)."""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        children = [c for c, _ in node.next_functions if c is not None]
        if expanded:
            memo[node] = node in targets or any(memo[c] for c in children)
        elif node not in memo:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in memo)
    return memo


def _params_below(children: Iterable[Node], param_of: dict[Node, torch.Tensor]) -> list[torch.Tensor]:
    found: dict[Node, torch.Tensor] = {}
    stack, seen = list(children), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in param_of:
            found[node] = param_of[node]
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return list(found.values())


def backward_input(root: torch.Tensor | GradientEdge, grad: torch.Tensor | None, stage_input: torch.Tensor,
                   params: Iterable[torch.Tensor]) -> tuple[torch.Tensor, WeightWork]:
    """B: the gradient of ``stage_input`` (a leaf that requires grad) from ``root`` (the stage's output, or
    its gradient edge, with ``grad``; or the last stage's loss with ``None``); weight gradients untouched,
    their work returned."""
    root_node = root.node if isinstance(root, GradientEdge) else root.grad_fn
    assert root_node is not None and stage_input.requires_grad
    input_node = get_gradient_edge(stage_input).node
    param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    to_input = _reaches(root_node, {input_node})
    to_params = _reaches(root_node, set(param_of))
    split: list[tuple[Node, list[torch.Tensor]]] = []
    # Output side first (``to_input`` is filled in post-order, inputs first): W then finishes the last layers'
    # weights first, as a whole backward does, so the sync's hook-fired buckets (last layers first) go out
    # during the W instead of all at its end. Each root is its own autograd call on its own weights: the
    # order moves no value.
    for node, on_input_path in reversed(to_input.items()):
        if not on_input_path or node is input_node:
            continue
        weight_only = [c for c, _ in node.next_functions if c is not None and to_params[c] and not to_input[c]]
        if weight_only:
            split.append((node, _params_below(weight_only, param_of)))
    uses = Counter(id(p) for _, ps in split for p in ps)
    if any(n > 1 for n in uses.values()):
        # A weight used at two places: the W of the upper use would run down the input path into the lower
        # one (and count it twice). Such a stage gets a whole backward here and an empty W.
        torch.autograd.backward(root, grad)  # type: ignore[arg-type]
        assert stage_input.grad is not None
        return stage_input.grad, WeightWork([])
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def recorder(node: Node):  # noqa: ANN202
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            recorded[node] = grad_outputs
        return hook

    hooks = [node.register_prehook(recorder(node)) for node, _ in split]
    try:
        (input_grad,) = torch.autograd.grad(root, [stage_input], grad, retain_graph=True)
    finally:
        for handle in hooks:
            handle.remove()
    return input_grad, WeightWork([(node, ps, recorded[node]) for node, ps in split if node in recorded])


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the weight gradients ``backward_input`` left out into ``.grad``; frees the graph."""
    for node, params, grads in work.roots:
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        if edges:
            torch.autograd.backward(edges, [g for g in grads if g is not None], inputs=params)
    work.roots.clear()
