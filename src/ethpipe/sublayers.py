"""Sub-layer stage boundaries: a plan's layer indices in half layers (docs/plan-format.md, "Sub-layer cuts").

With ``sublayers`` = 2 every layer index of a plan (stage ranges, chunks, gradient blocks) counts half layers:
unit ``2k`` is decoder layer k's attention half (its norm, attention and residual add), unit ``2k + 1`` its MLP
half. A stage may then end between a layer's attention and its MLP, where whole layers are too coarse for the
speed ratio of the devices it balances. Parameter names stay the model's own (``layers.7.attn.wq.weight``): a
checkpoint does not depend on where stages cut. Plain data, no torch: the plan, the cost model and the runtime
all read the units through here.
"""

from __future__ import annotations

SUBLAYER_CHOICES = (1, 2)
PARTS = ("attn", "mlp")  # a decoder layer's halves, in the order they run
_ATTENTION_MODULES = ("attn_norm", "attn")


def unit_of_parameter(name: str, sublayers: int) -> int:
    """The unit a decoder-layer parameter (``layers.<k>.<module>...``) belongs to."""
    parts = name.split(".")
    layer = int(parts[1])
    if sublayers == 1:
        return layer
    return 2 * layer + (0 if parts[2] in _ATTENTION_MODULES else 1)


def layer_parts(lo: int, hi: int, sublayers: int) -> list[tuple[int, tuple[str, ...]]]:
    """The decoder layers a unit range [lo, hi) runs, in order, each with the halves of it inside the range."""
    if sublayers == 1:
        return [(k, PARTS) for k in range(lo, hi)]
    out: list[tuple[int, tuple[str, ...]]] = []
    for unit in range(lo, hi):
        layer, part = divmod(unit, 2)
        if out and out[-1][0] == layer:
            out[-1] = (layer, PARTS)
        else:
            out.append((layer, (PARTS[part],)))
    return out


def attention_units(lo: int, hi: int, sublayers: int) -> int:
    """Attention halves in the unit range [lo, hi) (with ``sublayers`` 1: its layers, each has one)."""
    if sublayers == 1:
        return hi - lo
    return (hi + 1) // 2 - (lo + 1) // 2  # the even units
