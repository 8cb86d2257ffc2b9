"""Each STEM layer's MLP inputs over the calibration text, read by one forward of the dense model and kept in a file.

Everything a calibrated conversion computes from its text is a function of each layer's MLP inputs x at each
position: the calibrated means (the gate-weighted W_up x per token), a neuron choice's sums and costs, for any
table columns. Read once and kept, they serve the neuron choice (every neuron, the tokens it scores) and then the
rows of the columns it chose, without a second forward over the text: a forward costs as much as the rest of the
calibration together (SmolLM2-135M: 14 TFLOP for 64k tokens; the rows of a sixth of the neurons from the kept inputs,
1 TFLOP). The file holds [layers, windows, seq, d] in the dtype the model reads in, on the output's disk
(SmolLM2-135M, 64k tokens read in bf16: 2.3 GB), and goes with this object.
"""

import math
import sys
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..mapped import NoSpace, mapped_zeros
from ..stages import stage


WINDOWS_PER_FORWARD = 8  # SmolLM2-135M on 2 AMX cores: 8 windows of 512 a forward read 1.8x the tokens/s of one
MLP_INPUTS_BYTES = 8 * 2**30  # the most one file holds: more layers are read in groups, a forward each (Llama-3.2-1B's
# recipe calibrates on 1M tokens: 4.3 GB a layer in bf16, 69 GB for its 16)


def layer_groups(layers: list[int], windows: torch.Size, hidden: int, dtype: torch.dtype) -> list[list[int]]:
    """`layers` in order, in groups whose inputs over `windows` [n, seq] take at most MLP_INPUTS_BYTES (one at
    least): one group for SmolLM2-135M's default conversion (2.3 GB)."""
    group = max(1, MLP_INPUTS_BYTES // MlpInputs.nbytes(*windows, 1, hidden, dtype))
    return [layers[i : i + group] for i in range(0, len(layers), group)]


class _Stop(Exception):
    """Raised after the last layer's MLP input is kept: the rest of the forward is not needed."""


class MlpInputs:
    """The MLP inputs of `layers` of the dense `model` at every position of `windows` [n, seq] (right-padded rows
    whose padding no one reads are fine: causal attention keeps the real positions as they are), WINDOWS_PER_FORWARD
    windows a forward, kept in a file in `folder` (None: the temp dir)."""

    def __init__(self, model, layers: list[int], windows: torch.Tensor, folder=None, progress: bool = False,
                 report: bool = True):
        self.layers, self.windows = sorted(layers), windows
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        dtype = next(model.parameters()).dtype
        shape = (len(self.layers), *windows.shape, model.config.hidden_size)
        self._file = tempfile.NamedTemporaryFile(dir=folder, prefix=".stem-upcycle-mlp-inputs-", suffix=".bin")
        try:
            self.inputs = mapped_zeros(Path(self._file.name), shape, dtype)
        except NoSpace:
            raise UserError(f"no space for the calibration's MLP inputs in {Path(self._file.name).parent}: they take "
                            f"{math.prod(shape) * dtype.itemsize / 2**30:.2f} GiB while the rows are computed; free "
                            f"space there") from None
        with stage("read text", f"{len(windows):,} windows of {windows.shape[1]} tokens", report):
            self._read(model, progress)

    @staticmethod
    def nbytes(windows: int, seq: int, layers: int, hidden: int, dtype: torch.dtype) -> int:
        """Bytes of the file for `windows` x `seq` positions of `layers` layers of width `hidden`."""
        return windows * seq * layers * hidden * dtype.itemsize

    def layer(self, layer: int) -> torch.Tensor:
        """[n, seq, d] `layer`'s MLP inputs (the file's, not a copy)."""
        return self.inputs[self.index[layer]]

    @torch.no_grad()
    def _read(self, model, progress: bool) -> None:
        current = {}
        last = self.layers[-1]

        def keep(layer):
            def hook(module, args):
                self.inputs[self.index[layer], current["windows"]] = args[0].to("cpu", self.inputs.dtype)
                if layer == last:
                    raise _Stop
            return hook

        hooks = [model.base_model.layers[layer].mlp.register_forward_pre_hook(keep(layer)) for layer in self.layers]
        bar = tqdm(total=len(self.windows), desc="read text", unit="window", disable=not progress, file=sys.stderr)
        try:
            for start in range(0, len(self.windows), WINDOWS_PER_FORWARD):
                current["windows"] = slice(start, start + WINDOWS_PER_FORWARD)
                try:
                    model(self.windows[current["windows"]].to(model.device), use_cache=False)
                except _Stop:
                    pass
                bar.update(len(self.windows[current["windows"]]))
        finally:
            bar.close()
            for hook in hooks:
                hook.remove()
