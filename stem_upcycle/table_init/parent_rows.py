"""Rows from the parent itself: every vocabulary token read by the dense model after P contexts.

A token's row should be the up-activation its table columns take where the token occurs. Calibration text shows
a token in its own contexts, but only the tokens it holds: most of a 49k-128k vocabulary never occurs in the text
a CPU can read, and a rare token's mean over one or two contexts is noise. Here the parent reads every token v at
one position after each of P contexts (L tokens of text each: the calibration's, or the parent's own sampled text)
and v's row is the gate-weighted mean of its table columns' up-activations there, sum_p g^2 u / sum_p g^2
(elementwise), as a calibrated row is over the text (calibrated.py): the design card's "projecting each vocabulary
token's up-projection activations". On new genres such rows are as good as calibrated ones from 98k tokens of
broad text (SmolLM2-135M, issue 53), and better than the ridge map from the embedding for tokens a calibration
never showed.

Many tokens share a forward: a batch holds R contexts, each followed by the same B candidate tokens, every
candidate at the position after its context, attending to the context and to itself alone (a 4D mask), so the
contexts are computed once for B tokens. The parent's own gate and up projections are read at the candidates'
positions by hooks (no product computed twice), and the forward stops after the last STEM layer's MLP. Cost:
vocab x P positions of the parent (SmolLM2-135M, 16 contexts: 0.8M, minutes on 2 CPU cores in bf16; Llama-3.2-1B:
2.1M, a minute or two on a GPU). Every chunk of B tokens is computed alike wherever it runs, so processes can share
the chunks and get the rows one process would.
"""

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from ..families import Family
from ..neurons import NeuronSplit

ROWS_PER_FORWARD = 8  # contexts (each followed by the candidates) in one forward
CANDIDATES = 464  # candidate tokens after each context: a row of 48 + 464 = 512 positions


@dataclass(frozen=True)
class ParentRowOptions:
    """How the parent reads each token: after `contexts` contexts of `context_length` tokens each."""

    contexts: int = 16  # P: contexts each token is read after; 0: no parent rows (the ridge map for unseen tokens)
    context_length: int = 48  # L: tokens of text before the token
    seed: int = 0  # where in the text the contexts are cut
    dtype: str = "auto"  # what the parent computes in: auto (loading.fast_dtype: bf16 where native), float32, ...

    def positions(self, vocab_size: int) -> int:
        """Forward positions the parent runs for every token's row (the contexts' own positions besides)."""
        return vocab_size * self.contexts


class _Stop(Exception):
    """Raised after the last STEM layer's MLP: the rest of the forward is not needed."""


def cut_contexts(windows: torch.Tensor, options: ParentRowOptions) -> torch.Tensor:
    """[P, L] contexts from text windows [n, seq]: P windows spread over them (so that every text and genre of a
    mix gives some), each cut at a seeded offset."""
    n, seq = windows.shape
    length = min(options.context_length, seq)
    picked = torch.linspace(0, n - 1, options.contexts).round().long()
    generator = torch.Generator().manual_seed(options.seed)
    starts = torch.randint(0, seq - length + 1, (options.contexts,), generator=generator)
    return torch.stack([windows[w, s : s + length] for w, s in zip(picked.tolist(), starts.tolist())])


def context_batch(contexts: torch.Tensor, candidates: torch.Tensor, config, dtype: torch.dtype):
    """(ids [R, L + B], positions [R, L + B], attention masks) of contexts [R, L] each followed by the candidates [B]:
    causal over the context, each candidate at position L seeing the context and itself alone. The masks are
    additive [R, 1, L + B, L + B] (the eager attention of Gemma 2 adds them), a dict of one per layer type where
    the model mixes sliding and full attention (as its own forward builds them), the window applied where the
    config names one."""
    rows, length = contexts.shape
    device = contexts.device
    ids = torch.cat([contexts, candidates[None].expand(rows, -1).to(device)], 1)
    positions = torch.cat([torch.arange(length), torch.full((candidates.numel(),), length)]).to(device)
    candidate = positions.new_zeros(ids.shape[1], dtype=torch.bool)
    candidate[length:] = True
    q, k = positions[:, None], positions[None, :]
    allowed = (k <= q) & (~candidate[None, :] | torch.eye(len(positions), dtype=torch.bool, device=device))

    def additive(mask):
        n = mask.shape[0]
        return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)[None, None] \
            .expand(rows, 1, n, n)

    types, window = getattr(config, "layer_types", None), getattr(config, "sliding_window", None)
    windowed = additive(allowed & (k > q - window)) if window else None
    if types and "sliding_attention" in types:
        masks = {"full_attention": additive(allowed), "sliding_attention": windowed}
    else:  # a family without layer types (Mistral) slides its window in every layer where it has one
        masks = windowed if types is None and window else additive(allowed)
    return ids, positions[None].expand(rows, -1), masks


class ParentReader:
    """Reads tokens' parent rows from the dense `model` for `layers` (a layer's table columns: the neurons of its
    split in `columns`, else every neuron), after the `contexts` [P, L]. The model computes in its own dtype; the
    sums are fp32."""

    def __init__(self, model, family: Family, activation: str, layers: list[int], contexts: torch.Tensor,
                 columns: dict[int, NeuronSplit] | None = None, gate_weighted: bool = True):
        self.model, self.family, self.layers = model, family, sorted(layers)
        self.activation = ACT2FN[activation]
        self.contexts = contexts.to(model.device)
        self.columns = columns or {}
        self.gate_weighted = gate_weighted

    def rows(self, ids: torch.Tensor, progress: bool = False, description: str = "parent rows",
             emit: Callable[[torch.Tensor, dict[int, torch.Tensor]], None] | None = None,
             chunks: range | None = None) -> dict[int, torch.Tensor] | None:
        """The rows of `ids` [n]: {layer: [n, k] fp32 on the CPU}, or with `emit`, each chunk of CANDIDATES ids handed
        to emit(chunk ids, {layer: rows}) as it is done and nothing returned. `chunks`: which chunks to compute
        (this process's share; default all)."""
        count = math.ceil(ids.numel() / CANDIDATES)
        chunks = range(count) if chunks is None else chunks
        out = None if emit else {layer: [] for layer in self.layers}
        for c in tqdm(chunks, desc=description, unit="chunk", disable=not progress, file=sys.stderr):
            chunk = ids[c * CANDIDATES : (c + 1) * CANDIDATES]
            rows = self._chunk(chunk)
            if emit:
                emit(chunk, rows)
            else:
                for layer, r in rows.items():
                    out[layer].append(r)
        return None if emit else {layer: torch.cat(r) if r else torch.zeros(0) for layer, r in out.items()}

    @torch.no_grad()
    def _chunk(self, candidates: torch.Tensor) -> dict[int, torch.Tensor]:
        """{layer: [B, k]} the gate-weighted mean over every context of the candidates' table-column up-activations."""
        device, dtype = self.model.device, next(self.model.parameters()).dtype
        length = self.contexts.shape[1]
        sums = {}
        captured = {}
        hooks = []
        base = self.model.base_model

        def keep(layer, kind):
            def hook(module, args, output):
                captured[(layer, kind)] = output[:, length:]  # [R, B, out]: the candidates' positions
            return hook

        def accumulate(layer):
            def hook(module, args, output):
                gate, up = self._projections(layer, captured)  # [R, B, k] each, the MLP's output computed already
                captured.clear()
                num, den = sums.setdefault(layer, (torch.zeros_like(up[0]), torch.zeros_like(up[0])))
                if self.gate_weighted:  # in place: a few passes over [R, B, k] fp32 cost what the forward does
                    w = self.activation(gate).square_()
                    den += w.sum(0)
                    num += w.mul_(up).sum(0)
                else:
                    num += up.sum(0)
                    den += len(up)
                if layer == self.layers[-1]:
                    raise _Stop
            return hook

        for layer in self.layers:
            block = base.layers[layer]
            if self.family.fused_gate_up:
                hooks.append(block.get_submodule(self.family.fused_gate_up).register_forward_hook(keep(layer, "fused")))
            else:
                hooks.append(block.get_submodule(self.family.gate).register_forward_hook(keep(layer, "gate")))
                hooks.append(block.get_submodule(self.family.up).register_forward_hook(keep(layer, "up")))
            hooks.append(block.mlp.register_forward_hook(accumulate(layer)))
        try:
            for contexts in self.contexts.split(ROWS_PER_FORWARD):
                ids, positions, mask = context_batch(contexts, candidates.to(device), self.model.config, dtype)
                try:
                    base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
                except _Stop:
                    pass
        finally:
            for hook in hooks:
                hook.remove()
        return {layer: (num / den.clamp_min(1e-12)).cpu() for layer, (num, den) in sums.items()}

    def _projections(self, layer: int, captured: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate pre-activation, up) [R, B, k] in fp32 of `layer`'s table columns, from its captured outputs."""
        if self.family.fused_gate_up:
            gate, up = captured[(layer, "fused")].chunk(2, dim=-1)  # gate rows first
        else:
            gate, up = captured[(layer, "gate")], captured[(layer, "up")]
        if layer in self.columns:
            table = self.columns[layer].table.to(gate.device)
            gate, up = gate.index_select(-1, table), up.index_select(-1, table)
        return gate.float(), up.float()


class ParentPrior:
    """Parent rows (`ParentReader`) for a conversion's layers, each of `widths[layer]` table columns.

    With `whole`, the first use reads the whole vocabulary into a file-backed tensor in `folder` [vocab, the sum of
    the widths] (a token's rows of every layer side by side, as a chunk computes them): for a 1B model that is a
    table's worth of bytes, more than memory holds. Else the ids asked for are read as they are asked for, every
    layer's rows at once, and kept in memory (a neuron choice scores a few thousand tokens)."""

    def __init__(self, reader: ParentReader, widths: dict[int, int], vocab_size: int, dtype: torch.dtype,
                 folder=None, whole: bool = True, progress: bool = False):
        self.reader, self.vocab_size, self.dtype, self.folder = reader, vocab_size, dtype, folder
        self.read_whole, self.progress = whole, progress
        self.offsets, start = {}, 0
        for layer in sorted(widths):
            self.offsets[layer] = (start, start + widths[layer])
            start += widths[layer]
        self.width = start
        self.known_ids = torch.zeros(0, dtype=torch.long)  # sorted ids read so far (not `whole`)
        self.known = torch.zeros(0, self.width, dtype=dtype)
        self.whole = None  # [vocab, width] once read
        self._file = None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole vocabulary's rows."""
        return self.vocab_size * self.width * self.dtype.itemsize

    def rows(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), k] fp32: the parent rows of `ids` (any order) in `layer`."""
        lo, hi = self.offsets[layer]
        if self.read_whole:
            return self._vocabulary()[ids, lo:hi].float()
        self.read(ids)
        return self.known[torch.searchsorted(self.known_ids, ids), lo:hi].float()

    def read(self, ids: torch.Tensor) -> None:
        """Read the rows of `ids` not read yet (every layer's). The reader runs the model: a caller that needs rows
        inside a forward of the same model (a hook) reads them before it."""
        if self.read_whole:
            self._vocabulary()
            return
        missing = ids[~torch.isin(ids, self.known_ids)].unique()
        if missing.numel():
            read = self.reader.rows(missing)
            new = torch.cat([read[l].to(self.dtype) for l in sorted(self.offsets)], 1)
            every = torch.cat([self.known_ids, missing])
            order = every.argsort()
            self.known_ids, self.known = every[order], torch.cat([self.known, new])[order]

    def block(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """[stop - start, k] fp32: the parent rows of tokens [start, stop) in `layer`."""
        lo, hi = self.offsets[layer]
        return self._vocabulary()[start:stop, lo:hi].float()

    def _vocabulary(self) -> torch.Tensor:
        """[vocab, width] every token's rows, read at the first call."""
        if self.whole is not None:
            return self.whole
        import tempfile

        from ..errors import UserError
        from ..mapped import NoSpace, mapped_zeros

        self._file = tempfile.NamedTemporaryFile(dir=self.folder, prefix=".stem-upcycle-parent-rows-", suffix=".bin")
        try:
            whole = mapped_zeros(Path(self._file.name), (self.vocab_size, self.width), self.dtype)
        except NoSpace:
            raise UserError(f"no space for the parent's rows in {Path(self._file.name).parent}: they take "
                            f"{self.nbytes / 2**30:.2f} GiB while the tables are written; free space there") from None

        def keep(ids: torch.Tensor, rows: dict[int, torch.Tensor]) -> None:
            whole[ids] = torch.cat([rows[l].to(self.dtype) for l in sorted(self.offsets)], 1)

        self.reader.rows(torch.arange(self.vocab_size), progress=self.progress, emit=keep,
                         description=f"parent rows: {self.vocab_size} tokens x {len(self.reader.contexts)} contexts")
        self.whole = whole
        return whole
