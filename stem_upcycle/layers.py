"""Which decoder layers become STEM layers: parse `--layers`.

Forms (n = number of decoder layers):
  all           every layer
  1/3           that fraction of the layers, evenly spaced from layer 0 (1/3 of 30 -> 0, 3, ..., 27)
  1::2          a Python slice start:stop:step (every other layer from layer 1)
  0,4,8-11      an explicit list; a-b is an inclusive range
"""

import math
import re

from .errors import UserError

# Every layer, a share of each one's neurons as table columns (neurons.default_columns): at the same share of W_up,
# better than whole layers on every held-out genre (benchmarks/README.md, share_frontier.py). The closed-form
# init of the past placed whole layers: every third from layer 0 cost least there (SmolLM2-135M,
# benchmarks/layer_choice.py: 4.4e4 perplexity on held-out plays, against 1.2e6 from layer 1).
DEFAULT_LAYERS = "all"


class LayerSpecError(UserError):
    pass


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """Sorted, distinct layer indices named by `spec`, or a LayerSpecError naming the valid range."""
    text = spec.strip().lower()
    valid = f"valid layers are 0-{num_layers - 1}"
    if text == "all":
        return list(range(num_layers))
    if m := re.fullmatch(r"(\d+)\s*/\s*(\d+)", text):
        return _fraction(int(m.group(1)), int(m.group(2)), num_layers, spec)
    if ":" in text:
        parts = text.split(":")
        if len(parts) > 3 or not all(re.fullmatch(r"-?\d*", p.strip()) for p in parts):
            raise LayerSpecError(f"--layers {spec!r}: a slice is start:stop:step, e.g. 1::2")
        ints = [int(p) if p.strip() else None for p in parts] + [None] * (3 - len(parts))
        if ints[2] is not None and ints[2] <= 0:
            raise LayerSpecError(f"--layers {spec!r}: the step must be positive")
        layers = list(range(num_layers))[slice(*ints)]
    else:
        layers = []
        for item in text.split(","):
            if m := re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", item):
                lo, hi = int(m.group(1)), int(m.group(2))
                if lo > hi:
                    raise LayerSpecError(f"--layers {spec!r}: range {lo}-{hi} is empty")
                layers.extend(range(lo, hi + 1))
            elif re.fullmatch(r"\s*\d+\s*", item):
                layers.append(int(item))
            else:
                raise LayerSpecError(
                    f"--layers {spec!r} is not understood; use all, a fraction (1/3), a slice (1::2) "
                    f"or a list (0,4,8-11); {valid}"
                )
        if bad := [i for i in layers if i >= num_layers]:
            raise LayerSpecError(f"--layers {spec!r}: layer {bad[0]} does not exist; {valid}")
    if not layers:
        raise LayerSpecError(f"--layers {spec!r} selects no layer; {valid}")
    return sorted(set(layers))


def _fraction(num: int, den: int, num_layers: int, spec: str) -> list[int]:
    if den == 0 or num == 0 or num > den:
        raise LayerSpecError(f"--layers {spec!r}: a fraction must lie in (0, 1], e.g. 1/3")
    count = max(1, round(num_layers * num / den))
    return [math.floor(i * num_layers / count) for i in range(count)]  # 1/3 of 30 -> 0, 3, ..., 27
