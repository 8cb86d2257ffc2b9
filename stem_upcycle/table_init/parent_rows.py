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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers.activations import ACT2FN

from ..families import Family
from ..neurons import NeuronSplit
from ..stages import stage

ROWS_PER_FORWARD = 8  # (context, candidates) rows in one forward
CANDIDATES = 464  # candidate tokens after each context: a row of 48 + 464 = 512 positions


@dataclass(frozen=True)
class ParentRowOptions:
    """How the parent reads each token: after `reads` of `contexts` contexts of `context_length` tokens each."""

    contexts: int = 16  # P: contexts cut from the text, the most a token is read after; 0: no parent rows (the ridge map)
    # B: contexts each token is read after (B >= P: every token after all P, no correction). SmolLM2-135M, a sixth of
    # every layer (benchmarks/README.md, parent_budget.py): 4 of 16 within 0.031 of all 16 on eight genres; 2 to 0.057
    reads: int = 4
    context_length: int = 48  # L: tokens of text before the token
    seed: int = 0  # where in the text the contexts are cut, and which tokens share contexts
    dtype: str = "auto"  # what the parent computes in: auto (loading.fast_dtype: bf16 where native), float32, ...

    @property
    def per_token(self) -> int:
        """Contexts each token is read after."""
        return min(self.reads, self.contexts)

    def positions(self, vocab_size: int) -> int:
        """Forward positions the parent runs for every token's row (the contexts' own positions besides)."""
        return vocab_size * self.per_token


class ContextSets:
    """Which contexts each token is read after: the vocabulary split at random into sets of equal size, set s read
    after the B contexts s*B, s*B + 1, ... (mod P), so that every context serves as many tokens and no token's row
    shares another set's contexts; one set of all P contexts when B >= P. Tokens of one set share their contexts'
    main effect, what those contexts add to every token's up-activation: `ParentPrior` estimates it (the set's mean
    row against every set's) and takes it off. What B of P costs in quality: benchmarks/README.md, parent_budget.py."""

    def __init__(self, options: ParentRowOptions, vocab_size: int):
        p, b = options.contexts, options.per_token
        self.count = p // math.gcd(p, b)
        self.members = [[(s * b + i) % p for i in range(b)] for s in range(self.count)]
        order = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(options.seed))
        self.of_token = order % self.count  # [vocab]: each token's set, the sets' sizes differing by one at most


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
    """(ids [R, L + B], positions [R, L + B], attention masks) of contexts [R, L] each followed by its row of
    candidates [R, B]: causal over the context, each candidate at position L seeing the context and itself alone. The
    masks are additive [R, 1, L + B, L + B] (the eager attention of Gemma 2 adds them), a dict of one per layer type
    where the model mixes sliding and full attention (as its own forward builds them), the window applied where the
    config names one."""
    rows, length = contexts.shape
    device = contexts.device
    ids = torch.cat([contexts, candidates.to(device)], 1)
    positions = torch.cat([torch.arange(length), torch.full((candidates.shape[1],), length)]).to(device)
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


@dataclass
class _Chunk:
    """Up to CANDIDATES tokens of one set, read after each of the set's contexts; the sums over those so far."""

    ids: torch.Tensor
    where: torch.Tensor  # their places in the ids asked for
    contexts: list[int]
    sums: dict = field(default_factory=dict)  # layer -> (num, den) [len(ids), k]
    left: int = 0  # contexts not read yet


class ParentReader:
    """Reads tokens' parent rows from the dense `model` for `layers` (a layer's table columns: the neurons of its
    split in `columns`, else every neuron), each token after its set's contexts of `contexts` [P, L] (`sets`: one set
    of all P when not given). The model computes in its own dtype; the sums are fp32."""

    def __init__(self, model, family: Family, activation: str, layers: list[int], contexts: torch.Tensor,
                 columns: dict[int, NeuronSplit] | None = None, gate_weighted: bool = True,
                 sets: ContextSets | None = None):
        self.model, self.family, self.layers = model, family, sorted(layers)
        self.activation = ACT2FN[activation]
        self.contexts = contexts.to(model.device)
        self.columns = columns or {}
        self.gate_weighted = gate_weighted
        self.sets = sets

    def rows(self, ids: torch.Tensor, progress: bool = False, description: str = "parent rows",
             emit: Callable[[torch.Tensor, dict[int, torch.Tensor]], None] | None = None) -> dict[int, torch.Tensor] | None:
        """The rows of `ids` [n]: {layer: [n, k] fp32 on the CPU}, or with `emit`, each chunk of up to CANDIDATES ids
        (of one set) handed to emit(chunk ids, {layer: rows}) as it is done and nothing returned."""
        chunks = self._chunks(ids)
        work = [(chunk, context) for chunk in chunks for context in chunk.contexts]  # a chunk's contexts together
        out = None if emit else {layer: None for layer in self.layers}
        bar = tqdm(total=len(work), desc=description, unit="context", disable=not progress, file=sys.stderr)
        for start in range(0, len(work), ROWS_PER_FORWARD):
            batch = work[start : start + ROWS_PER_FORWARD]
            self._forward(batch)
            bar.update(len(batch))
            for chunk in {id(c): c for c, _ in batch}.values():
                if chunk.left:
                    continue
                rows = {layer: (num / den.clamp_min(1e-12)).cpu() for layer, (num, den) in chunk.sums.items()}
                chunk.sums = {}
                if emit:
                    emit(chunk.ids, rows)
                    continue
                for layer, r in rows.items():  # back in the order of `ids`
                    if out[layer] is None:
                        out[layer] = torch.empty(ids.numel(), r.shape[1])
                    out[layer][chunk.where] = r
        bar.close()
        if emit:
            return None
        return {layer: torch.zeros(0) if r is None else r for layer, r in out.items()}

    def _chunks(self, ids: torch.Tensor) -> list[_Chunk]:
        """`ids` in chunks of up to CANDIDATES tokens of one set each, a set's in the order of `ids`."""
        if self.sets is None or self.sets.count == 1:
            groups = [(torch.arange(ids.numel()), list(range(len(self.contexts))))]
        else:
            of = self.sets.of_token[ids]
            groups = [((of == s).nonzero()[:, 0], members) for s, members in enumerate(self.sets.members)]
        return [_Chunk(ids[where[i : i + CANDIDATES]], where[i : i + CANDIDATES], contexts, left=len(contexts))
                for where, contexts in groups for i in range(0, where.numel(), CANDIDATES)]

    @torch.no_grad()
    def _forward(self, batch: list[tuple[_Chunk, int]]) -> None:
        """One forward of the rows `batch` (a chunk and one of its contexts each), their sums added to each chunk's:
        the gate-weighted table-column up-activations of the chunk's candidates (shorter chunks padded, the padding
        discarded)."""
        device, dtype = self.model.device, next(self.model.parameters()).dtype
        length = self.contexts.shape[1]
        width = max(chunk.ids.numel() for chunk, _ in batch)
        candidates = torch.stack([torch.nn.functional.pad(chunk.ids, (0, width - chunk.ids.numel()))
                                  for chunk, _ in batch])  # [R, B]
        contexts = self.contexts[torch.tensor([context for _, context in batch], device=device)]
        spans = []  # (chunk, first row, last row + 1): a chunk's rows lie together
        for r, (chunk, _) in enumerate(batch):
            if spans and spans[-1][0] is chunk:
                spans[-1][2] = r + 1
            else:
                spans.append([chunk, r, r + 1])
        captured, hooks = {}, []
        base = self.model.base_model

        def keep(layer, kind):
            def hook(module, args, output):
                captured[(layer, kind)] = output[:, length:]  # [R, B, out]: the candidates' positions
            return hook

        def accumulate(layer):
            def hook(module, args, output):
                gate, up = self._projections(layer, captured)  # [R, B, k] each, the MLP's output computed already
                captured.clear()
                for chunk, first, last in spans:
                    n = chunk.ids.numel()
                    g, u = gate[first:last, :n], up[first:last, :n]
                    num, den = chunk.sums.setdefault(layer, (torch.zeros_like(u[0]), torch.zeros_like(u[0])))
                    if self.gate_weighted:  # in place: a few passes over [R, B, k] fp32 cost what the forward does
                        w = self.activation(g).square_()
                        den += w.sum(0)
                        num += w.mul_(u).sum(0)
                    else:
                        num += u.sum(0)
                        den += len(u)
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
            ids, positions, mask = context_batch(contexts, candidates.to(device), self.model.config, dtype)
            try:
                base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
            except _Stop:
                pass
        finally:
            for hook in hooks:
                hook.remove()
        for chunk, first, last in spans:
            chunk.left -= last - first

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


SET_EFFECT_SHRINK = 64.0  # a set's effect over n tokens weighs n / (n + this): the mean of a few rows is theirs, not the contexts'


class ParentPrior:
    """Parent rows (`ParentReader`) for a conversion's layers, each of `widths[layer]` table columns, with the main
    effect of each token's contexts taken off (`ContextSets`).

    With `whole`, the first use reads the whole vocabulary into a file-backed tensor in `folder` [vocab, the sum of
    the widths] (a token's rows of every layer side by side, as a chunk computes them): for a 1B model that is a
    table's worth of bytes, more than memory holds. Else the ids asked for are read as they are asked for, every
    layer's rows at once, and kept in memory (a neuron choice scores a few thousand tokens). A set's effect is the
    mean of its tokens' rows against the mean of every token read, weighed n / (n + SET_EFFECT_SHRINK) by its n
    tokens read."""

    def __init__(self, reader: ParentReader, widths: dict[int, int], vocab_size: int, dtype: torch.dtype,
                 folder=None, whole: bool = True, progress: bool = False, report: bool = True):
        self.reader, self.vocab_size, self.dtype, self.folder = reader, vocab_size, dtype, folder
        self.read_whole, self.progress, self.report = whole, progress, report
        self.offsets, start = {}, 0
        for layer in sorted(widths):
            self.offsets[layer] = (start, start + widths[layer])
            start += widths[layer]
        self.width = start
        self.known_ids = torch.zeros(0, dtype=torch.long)  # sorted ids read so far (not `whole`)
        self.known = torch.zeros(0, self.width, dtype=dtype)
        self.whole = None  # [vocab, width] once read
        self._file = None
        sets = reader.sets
        self.of_set = None if sets is None or sets.count == 1 else sets.of_token  # [vocab], None: one set
        count = 1 if self.of_set is None else sets.count
        self.set_sums = torch.zeros(count, self.width, dtype=torch.float64)  # of the rows read, per set
        self.set_sizes = torch.zeros(count, dtype=torch.float64)
        self.effects = None  # [sets, width] fp32, once computed

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
        return self._corrected(self.known[torch.searchsorted(self.known_ids, ids), lo:hi].float(), ids, lo, hi)

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
            self._count(missing, new)
            every = torch.cat([self.known_ids, missing])
            order = every.argsort()
            self.known_ids, self.known = every[order], torch.cat([self.known, new])[order]

    def block(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """[stop - start, k] fp32: the parent rows of tokens [start, stop) in `layer`."""
        lo, hi = self.offsets[layer]
        return self._vocabulary()[start:stop, lo:hi].float()

    def _count(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Add rows [n, width] of `ids` to their sets' sums (their effects computed again when next used)."""
        if self.of_set is None:
            return
        of = self.of_set[ids]
        self.set_sums.index_add_(0, of, rows.double())
        self.set_sizes += torch.bincount(of, minlength=self.set_sizes.numel())
        self.effects = None

    def _corrected(self, rows: torch.Tensor, ids: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """`rows` [n, hi - lo] fp32 of `ids` with their sets' effects on columns [lo, hi) taken off."""
        if self.of_set is None:
            return rows
        if self.effects is None:
            read = self.set_sizes.clamp_min(1)[:, None]
            grand = self.set_sums.sum(0) / self.set_sizes.sum().clamp_min(1)
            weight = self.set_sizes / (self.set_sizes + SET_EFFECT_SHRINK)
            self.effects = ((self.set_sums / read - grand) * weight[:, None]).float()
        return rows - self.effects[self.of_set[ids], lo:hi]

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
            every = torch.cat([rows[l].to(self.dtype) for l in sorted(self.offsets)], 1)
            whole[ids] = every
            self._count(ids, every)

        self.set_sums.zero_(), self.set_sizes.zero_()  # the whole vocabulary's effects, not those of tokens read before
        per_token = len(self.reader.sets.members[0]) if self.reader.sets is not None else len(self.reader.contexts)
        with stage("parent rows", f"{self.vocab_size:,} tokens x {per_token} of {len(self.reader.contexts)} contexts",
                   self.report):
            self.reader.rows(torch.arange(self.vocab_size), progress=self.progress, emit=keep, description="parent rows")
            for start in range(0, self.vocab_size, CANDIDATES * ROWS_PER_FORWARD):  # the effects taken off, once
                ids = torch.arange(start, min(start + CANDIDATES * ROWS_PER_FORWARD, self.vocab_size))
                whole[ids] = self._corrected(whole[ids].float(), ids).to(self.dtype)
        self.whole = whole
        return whole
