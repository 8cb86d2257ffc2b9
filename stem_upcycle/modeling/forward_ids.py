"""A forward's ids, from the base model's pre-hook to the STEM MLPs, and the run-time edits that travel with them.

A forward's ids travel in a `ForwardIds`, kept per thread (`IdHandoff`), which also holds the copies
the row sources need (on each device, on the CPU, distinct ids) so that each is made once per
forward. A run-time edit (`RowEdit`) adds the ids whose rows replace those of some positions to the
ids a forward looks up, so that every placement serves them as it serves the rest (a device row
cache included).

Exported next to the weights, so it imports only torch, transformers and the standard library.
"""

import threading
from dataclasses import dataclass

import torch


class ForwardIds:
    """The input ids of one forward [batch, seq], the ids its tables are read at, and the copies made
    of those, each made once.

    Without an edit the lookup ids are the input ids. With one (`ForwardEdit`), they are the input
    ids flattened [batch * seq] followed by the edit's target ids [m]: the placements read those rows
    like any other, and `edited` puts them in place."""

    def __init__(self, ids: torch.Tensor, edit: "ForwardEdit | None" = None,
                 first: "tuple[torch.Tensor, torch.Tensor] | None" = None, first_mask: torch.Tensor | None = None):
        self.ids = ids
        self.edit = edit
        self.first = first  # (batch rows, positions) of the sequences' first tokens in this forward (`first_tokens`)
        self.first_mask = first_mask  # a compiled forward's instead: [batch, seq] bool (`first_token_mask`)
        self.lookup = ids if edit is None else torch.cat([ids.flatten(), edit.target_ids.flatten().to(ids.device)])
        self._on = {self.lookup.device: self.lookup}
        self._unique = None
        self.plan = None  # what a placement prepared for this forward (host: slots or staged rows)
        self.first_ups = None  # a small compiled forward's: layer -> [batch, seq, k] (`first_token_ups`)

    def on(self, device: torch.device) -> torch.Tensor:
        """The lookup ids on `device` (a split model's layers sit on several devices)."""
        if device not in self._on:
            # non_blocking only toward an accelerator: a non-blocking copy to the host returns a pinned buffer
            # still being written, and the host reads these ids at once (`unique`, row reads)
            self._on[device] = self.lookup.to(device, non_blocking=device.type != "cpu")
        return self._on[device]

    @property
    def cpu(self) -> torch.Tensor:
        return self.on(torch.device("cpu"))

    def unique(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted distinct lookup ids, index of each lookup into them), on the CPU."""
        if self._unique is None:
            self._unique = torch.unique(self.cpu, return_inverse=True)
        return self._unique

    def edited(self, rows: torch.Tensor, layer: int | None) -> torch.Tensor:
        """The rows [batch, seq, k] of the input ids from the rows read at the lookup ids; at the
        edit's positions, in the layers it edits, the weighted sums of its target rows instead."""
        if self.edit is None:
            return rows
        batch, seq = self.ids.shape
        own, extra = rows[: batch * seq].view(batch, seq, -1), rows[batch * seq :]  # [b, s, k], [m, k]
        if not self.edit.edits(layer):
            return own
        target = extra.view(*self.edit.target_ids.shape, -1)  # [n, targets, k]
        weights = self.edit.weights.to(target.device, target.dtype)[..., None]  # [n, targets, 1]
        own = own.clone()
        own[self.edit.rows.to(own.device), self.edit.positions.to(own.device)] = (target * weights).sum(1)
        return own


@dataclass(frozen=True)
class ForwardEdit:
    """The part of a `RowEdit` that falls in one forward: batch rows and positions of its input."""

    rows: torch.Tensor  # [n]
    positions: torch.Tensor  # [n] counted from the forward's first token
    target_ids: torch.Tensor  # [n, k]
    weights: torch.Tensor  # [n, k]
    layers: frozenset | None

    def edits(self, layer: int | None) -> bool:
        return self.layers is None or layer in self.layers


@dataclass(frozen=True)
class RowEdit:
    """A run-time edit of the rows a STEM model looks up: at some positions of a prompt, the weighted
    sum of other ids' rows replaces the row of the id there, in some STEM layers. Input ids, tables
    and every other position are untouched. Set on a model with `model.set_stem_row_edit(edit)`, for
    the forwards of the calling thread.

    It is made for a prompt, or a padded batch of prompts (`prompt_ids`, -1 at the padding), and a
    forward is checked to hold every token of them: an input that is another prompt, or the batch
    padded otherwise, is refused rather than edited at the wrong tokens. A batch of b*m rows is the
    b prompts each repeated m times in place (as generate() repeats them for beams or several
    returned sequences); one prompt edits every row of a batch of it. Positions count from the
    sequence's first token (padding included), so the edit follows the prompt through a KV cache:
    the forward reading positions p..p+s-1 (p: tokens already cached) edits those that fall there."""

    prompt_ids: torch.Tensor  # [b, L] the prompts as the input holds them, -1 at the padding
    rows: torch.Tensor  # [n] the prompt (row of prompt_ids) of each edited position
    positions: torch.Tensor  # [n] positions in the padded prompt; (row, position) pairs distinct
    target_ids: torch.Tensor  # [n, k] ids whose rows, weighted, replace the row at each position
    weights: torch.Tensor  # [n, k] (0 for the padding of positions that read fewer than k ids)
    layers: frozenset | None = None  # STEM layers edited; None: all

    def for_forward(self, ids: torch.Tensor, past: int) -> ForwardEdit | None:
        """The edit of a forward of `ids` [batch, seq] after `past` cached tokens; None if it edits none."""
        inside = (self.positions >= past) & (self.positions < past + ids.shape[1])
        if not bool(inside.any()):
            return None
        prompts, length = self.prompt_ids.shape
        if ids.shape[0] % prompts:
            raise ValueError(f"the row edit was made for {prompts} prompts and the input holds {ids.shape[0]} rows: "
                             f"the input is not the batch the edit was made for")
        copies = ids.shape[0] // prompts  # rows per prompt, in place: prompt r is rows r*copies .. r*copies+copies-1
        stop = min(past + ids.shape[1], length)
        expected = self.prompt_ids[:, past:stop].repeat_interleave(copies, 0)  # [batch, stop - past]
        found = ids[:, : stop - past].cpu()  # a copy per forward that edits (the prompt's)
        wrong = ((expected >= 0) & (expected != found)).any(1)
        if bool(wrong.any()):
            row = int(wrong.nonzero()[0])
            raise ValueError(f"the row edit expects ids {expected[row].tolist()} at positions {past}-{stop - 1} of row "
                             f"{row} (-1: padding) and the input holds {found[row].tolist()}: the input is not the "
                             f"prompt the edit was made for (a batch: padded as the tokenizer pads it)")
        rows = (self.rows[inside][:, None] * copies + torch.arange(copies)).flatten()  # [n * copies]
        return ForwardEdit(rows, (self.positions[inside] - past).repeat_interleave(copies),
                           self.target_ids[inside].repeat_interleave(copies, 0),
                           self.weights[inside].repeat_interleave(copies, 0), self.layers)


def first_tokens(ids: torch.Tensor, kwargs: dict, past: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(batch rows, positions) in a forward of `ids` [batch, seq] of each sequence's first token: where
    the position ids are 0 if the forward has them on the CPU, or has them with neither a mask nor a
    cache (vLLM packs a batch's sequences into one row [1, tokens], each numbered from 0); else the
    first position its 2-D attention mask admits (left padding skipped), position 0 without a mask.

    That token attends to itself alone, so its hidden states are a function of its id alone, unlike
    any other position's; the dense model makes it its attention sink. A forward after `past` cached
    tokens holds first tokens only where the padding reaches past the cache, which is checked where
    the mask is on the CPU; on an accelerator that check would stall every decode step on a copy to
    the host, so there first tokens are taken to be in the forward that starts the sequence (as in
    `generate()`, unless it prefills in chunks shorter than a left padding)."""
    mask = kwargs.get("attention_mask")
    batch, seq = ids.shape
    positions = kwargs.get("position_ids")
    if (positions is not None and positions.shape == ids.shape
            and (positions.device.type == "cpu" or (mask is None and not past))):
        rows, starts = (positions == 0).nonzero(as_tuple=True)
        return (rows, starts) if rows.numel() else None
    usable = mask is not None and mask.dim() == 2 and mask.shape == (batch, past + seq)
    if past and not (usable and mask.device.type == "cpu"):
        return None
    start = mask.int().argmax(1) if usable else torch.zeros(batch, dtype=torch.long, device=ids.device)  # [batch]
    rows = torch.arange(batch, device=start.device)
    if past:  # on the CPU: only the sequences whose first token falls in this forward
        inside = (start >= past) & (start < past + seq)
        if not bool(inside.any()):
            return None
        rows, start = rows[inside], start[inside]
    return rows, start - past


def first_token_mask(ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """[batch, seq] bool: which tokens of a forward are their sequence's first, computed on the ids' device
    without reading anything back to the host (a compiled forward's rule; `first_tokens` is the eager one):
    position id 0 where the forward has position ids; else, with a 2-D attention mask over the cached and the
    new tokens [batch, past + seq], the first position it admits (left padding skipped) if it falls among this
    forward's tokens (the last seq); else, after `past` cached tokens, position 0 if this forward holds it."""
    batch, seq = ids.shape
    positions = kwargs.get("position_ids")
    if positions is not None and positions.shape == ids.shape:
        return positions == 0
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        length = mask.shape[1]
        here = torch.arange(length - seq, length, device=ids.device)  # this forward's positions in the mask
        start = mask.to(ids.device).int().argmax(1)  # [batch]: the first admitted position
        return here[None, :] == start[:, None]
    past = cached_length(kwargs)
    return (torch.arange(past, past + seq, device=ids.device) == 0)[None, :].expand(batch, seq)


def cached_length(kwargs: dict) -> int:
    """Tokens already in the KV cache a decoder forward was given (`cache` in Transformers 5,
    `past_key_values` before)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2]) if len(cache) else 0  # legacy tuple of (key, value) per layer


class IdHandoff:
    """The current forward's ids of one model, per thread, so that two threads can run the model at once.

    Decoder layers hand only hidden states to their MLP. Gradient checkpointing recomputes layers
    during backward, which on an accelerator runs in autograd's own threads; there the ids of the
    model's latest forward are used (training runs one forward at a time).
    """

    def __init__(self):
        self._local = threading.local()
        self._latest = None
        # A compiled forward's ids, set and cleared by the base model's forward inside the traced graph: an
        # attribute dynamo follows (the graph then reads its own input ids, whatever the attribute holds later).
        self.compiled: ForwardIds | None = None

    @property
    def edit(self) -> "RowEdit | None":
        """The run-time edit of this thread's forwards (`RowEdit`), if any."""
        return getattr(self._local, "edit", None)

    @edit.setter
    def edit(self, edit: "RowEdit | None") -> None:
        self._local.edit = edit

    def start(self, ids: torch.Tensor, edit: ForwardEdit | None = None,
              first: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardIds:
        forward = ForwardIds(ids, edit, first)
        self._local.current = self._latest = forward
        return forward

    def current_of_thread(self) -> ForwardIds | None:
        return getattr(self._local, "current", None)

    def current(self, x: torch.Tensor) -> ForwardIds:
        if torch.compiler.is_compiling():
            if self.compiled is None or self.compiled.ids.shape != x.shape[:-1]:
                raise RuntimeError("a STEM MLP was compiled apart from its model's forward, which hands it the ids: "
                                   "compile the model's forward (torch.compile(model.forward)) or the model")
            return self.compiled
        forward = getattr(self._local, "current", None) or self._latest
        if forward is None or forward.ids.shape != x.shape[:-1]:
            raise RuntimeError(
                "STEM MLP called without matching input ids; call the model with input_ids so that "
                "its STEM layers can look up their table rows"
            )
        return forward


def check_ids(ids: torch.Tensor, vocab: int) -> None:
    """Ids outside the tables are a clear error. Checked only where the ids already are on the CPU:
    on an accelerator the check would stall every decode step on a device-to-host copy."""
    if ids.device.type == "cpu" and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids must lie in [0, {vocab - 1}] (the STEM tables have {vocab} rows); "
                             f"got values from {low} to {high}")
