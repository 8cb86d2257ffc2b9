"""Knowledge editing: what a STEM model's tables hold for one entity, read at another's tokens.

A STEM layer reads one row per token id, so what the model "knows" about an entity sits in the rows
of the entity's tokens. A swap `SOURCE=TARGET` makes the source's tokens read the target's rows:

- at run time (`runtime_edit`, weights untouched): at the positions where SOURCE stands in a
  prompt (or each prompt of a padded batch), found from the tokenizer's offsets, the looked-up rows
  are replaced; the input ids and every other position are unchanged;
- persistently (`apply_edit` on a loaded model, `write_edited_model` on checkpoint files): the rows
  of the source's tokens themselves become the target's, so every occurrence reads them.

An entity is tokenised in both spellings a text can hold it in: at the start of a text and after a
space (" Spain"), each mapped to the same spelling of the target. When the two spellings differ in
length, `MODES` say which target rows each source token reads (the STEM authors' harness modes).
"""

import json
import os
import shutil
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .atomic import staged_file, write_staged
from .errors import UserError
from .facts import complete
from .loading import model_from_source, stem_layers_of, stem_tables
from .modeling.forward_ids import RowEdit
from .modeling.table_files import StoredTable
from .source import open_source

MODES = {
    "auto": "one_to_one when source and target have as many tokens, else average",
    "one_to_one": "source token i reads target token i (equal lengths only)",
    "average": "every source token reads the mean of the target's rows",
    "copy": "source token i reads target token i mod the target's length (the target's rows cycled)",
    "left_pad": "the target right-aligned: padding tokens first, a longer target keeps its last tokens",
    "right_pad": "the target left-aligned: padding tokens last, a longer target keeps its first tokens",
}
OCCURRENCES = ("all", "last")
EDITS_FOLDER = "stem-edits"  # in an edited model: one safetensors record per edit, with the rows it replaced


class EditError(UserError):
    pass


# --- what a swap maps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Swap:
    source: str
    target: str

    @classmethod
    def parse(cls, text: str) -> "Swap":
        source, sep, target = text.partition("=")
        if not sep or not source.strip() or not target.strip():
            raise EditError(f"--swap {text!r} is not SOURCE=TARGET; e.g. --swap Spain=Germany")
        return cls(source.strip(), target.strip())

    def __str__(self) -> str:
        return f"{self.source}={self.target}"


@dataclass(frozen=True)
class Spelling:
    """One spelling of an entity (at a text's start, or after a space) and its token ids."""

    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class RowMap:
    """Which target rows each token of one spelling of the source reads after the edit."""

    swap: Swap
    source: Spelling
    target: Spelling
    mode: str  # the mode applied (auto resolved)
    reads: tuple[tuple[tuple[int, float], ...], ...]  # per source token: (target id, weight), ...


@dataclass(frozen=True)
class EditPlan:
    swaps: tuple[Swap, ...]
    mode: str
    maps: tuple[RowMap, ...]
    layers: tuple[int, ...]  # the STEM layers edited

    def new_rows(self) -> dict[int, tuple[tuple[int, float], ...]]:
        """Source token id -> what it reads, for a persistent edit (the first map naming an id wins)."""
        reads = {}
        for row_map in self.maps:
            for token, read in zip(row_map.source.ids, row_map.reads):
                reads.setdefault(token, read)
        return reads

    def conflicts(self) -> list[int]:
        """Source ids that two maps would have read differently (the first is kept; see `new_rows`)."""
        seen, clashes = {}, []
        for row_map in self.maps:
            for token, read in zip(row_map.source.ids, row_map.reads):
                if seen.setdefault(token, read) != read and token not in clashes:
                    clashes.append(token)
        return clashes

    def describe(self, tokenizer) -> str:
        lines = []
        for row_map in self.maps:
            src, tgt = row_map.source, row_map.target
            lines.append(f"{src.text!r} {_tokens(tokenizer, src.ids)} -> {tgt.text!r} {_tokens(tokenizer, tgt.ids)}"
                         f"  ({row_map.mode})")
        shared = sorted({t for m in self.maps if len(m.source.ids) > 1 for t in m.source.ids})
        if shared:
            lines.append(f"note: a persistent edit rewrites the rows of {_tokens(tokenizer, shared)} wherever they "
                         f"occur, not only in these entities")
        if clashes := self.conflicts():
            lines.append(f"note: tokens {_tokens(tokenizer, clashes)} belong to several spellings that map them "
                         f"differently; a persistent edit keeps the first mapping")
        lines.append(f"STEM layers edited: {list(self.layers)}")
        return "\n".join(lines)


def _tokens(tokenizer, ids) -> str:
    return "[" + ", ".join(repr(tokenizer.convert_ids_to_tokens(int(i))) for i in ids) + "]"


# Where an entity can stand: after a space (mid-text, first: where spellings share tokens, its mapping
# wins), at the start of a text, and glued to a character before it ("(Spain": SentencePiece-style
# tokenizers spell that without the word-start marker).
CONTEXTS = (("a ", " "), ("", ""), ("(", "("))  # (text before the entity, how the spelling is shown)


def spellings(tokenizer, entity: str) -> list[Spelling]:
    """The entity's distinct token spellings in CONTEXTS, from the tokenizer's offsets."""
    found = []
    for before, shown in CONTEXTS:
        ids = tuple(_span_ids(tokenizer, before + entity, len(before), len(before) + len(entity)))
        if not ids:
            raise EditError(f"{entity!r} tokenises to nothing; give an entity with visible text")
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
            raise EditError(f"{entity!r} holds characters this tokenizer does not know (it reads "
                            f"{tokenizer.unk_token!r}); give the entity as the model's texts spell it")
        if all(s.ids != ids for s in found):
            found.append(Spelling(shown + entity, ids))
    return found


def _span_ids(tokenizer, text: str, start: int, end: int) -> list[int]:
    """Ids of the tokens of `text` that cover its characters [start, end) (`_covering`)."""
    encoded = _encode(tokenizer, text, add_special_tokens=False)
    return [encoded["input_ids"][p] for p in _covering(text, encoded["offset_mapping"], start, end)]


def _covering(text: str, offsets, start: int, end: int) -> list[int]:
    """Positions of the tokens whose characters overlap [start, end), the space before `start` included
    (whether or not the tokenizer's offsets count it); special tokens (empty offsets) never."""
    begin = start - 1 if start and text[start - 1] == " " else start
    return [p for p, (a, b) in enumerate(offsets) if b > a and a < end and b > begin]


def _encode(tokenizer, text: str, **kwargs) -> dict:
    if not getattr(tokenizer, "is_fast", False):
        raise EditError("editing finds an entity's tokens from the tokenizer's offsets, which only fast tokenizers "
                        "give; load the model's tokenizer.json (a fast tokenizer)")
    return tokenizer(text, return_offsets_mapping=True, **kwargs)


def map_tokens(source_ids, target_ids, mode: str, pad_id: int) -> tuple[str, tuple]:
    """(mode applied, per source token the (target id, weight) pairs it reads)."""
    n, m = len(source_ids), len(target_ids)
    if mode == "auto":
        mode = "one_to_one" if n == m else "average"
    if mode == "one_to_one":
        if n != m:
            raise EditError(f"--mode one_to_one needs as many target tokens as source tokens ({m} vs {n}); use "
                            f"--mode auto, average, copy, left_pad or right_pad")
        reads = [[(t, 1.0)] for t in target_ids]
    elif mode == "average":
        reads = [[(t, 1.0 / m) for t in target_ids]] * n
    elif mode == "copy":
        reads = [[(target_ids[i % m], 1.0)] for i in range(n)]
    elif mode == "left_pad":
        aligned = [pad_id] * (n - m) + list(target_ids[-n:])
        reads = [[(t, 1.0)] for t in aligned]
    elif mode == "right_pad":
        aligned = list(target_ids[:n]) + [pad_id] * (n - m)
        reads = [[(t, 1.0)] for t in aligned]
    else:
        raise EditError(f"--mode {mode!r} is unknown; choose one of {', '.join(MODES)}")
    return mode, tuple(tuple(r) for r in reads)


def pad_token_id(tokenizer) -> int:
    """The padding of the pad modes: the pad token, else EOS, else BOS (as the authors' harness does)."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id):
        if token is not None:
            return int(token)
    raise EditError("the tokenizer has no pad, EOS or BOS token to pad with; use --mode average or copy")


def plan_edit(tokenizer, config, swaps, mode: str = "auto", layers=None) -> EditPlan:
    """The rows each swap maps, for the STEM model of `config` (a dense config is refused)."""
    layers = tuple(stem_layers_of(config, layers))
    swaps = tuple(s if isinstance(s, Swap) else Swap.parse(s) for s in swaps)
    if not swaps:
        raise EditError("nothing to edit: give at least one --swap SOURCE=TARGET")
    maps = []
    for swap in swaps:
        sources, targets = spellings(tokenizer, swap.source), spellings(tokenizer, swap.target)
        for spelling in sources + targets:
            if max(spelling.ids) >= config.vocab_size:
                raise EditError(f"{spelling.text!r} has token id {max(spelling.ids)}, past the tables' "
                                f"{config.vocab_size} rows: the tokenizer and the model do not belong together")
        for i, source in enumerate(sources):
            target = targets[min(i, len(targets) - 1)]  # the same spelling of the target
            pad = pad_token_id(tokenizer) if mode.endswith("_pad") else -1
            applied, reads = map_tokens(source.ids, target.ids, mode, pad)
            maps.append(RowMap(swap, source, target, applied, reads))
    return EditPlan(swaps, mode, tuple(maps), layers)


# --- at run time -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Occurrence:
    """Where a source entity stands in a prompt: characters, token positions, the map its tokens use."""

    swap: Swap
    chars: tuple[int, int]
    positions: tuple[int, ...]
    row_map: RowMap


def find_occurrences(tokenizer, prompt: str, plan: EditPlan, which: str = "all") -> list[Occurrence]:
    """The occurrences of each swap's source in `prompt` (tokenised as the model reads it), from the
    tokenizer's offsets: the tokens covering the entity's characters must be one of its spellings
    (so "Spain" inside "Spaniard" is no occurrence). `which`: all, or the last one of each source."""
    if which not in OCCURRENCES:
        raise EditError(f"occurrences={which!r}: choose one of {', '.join(OCCURRENCES)}")
    encoded = _encode(tokenizer, prompt)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    found = []
    for swap in plan.swaps:
        maps = [m for m in plan.maps if m.swap == swap]
        mine = []
        start = prompt.find(swap.source)
        while start >= 0:
            end = start + len(swap.source)
            positions = _covering(prompt, offsets, start, end)
            covered = tuple(ids[p] for p in positions)
            row_map = next((m for m in maps if m.source.ids == covered), None)
            inside_a_word = (start and prompt[start - 1].isalnum()) or (end < len(prompt) and prompt[end].isalnum())
            if row_map is not None and not inside_a_word:
                mine.append(Occurrence(swap, (start, end), tuple(positions), row_map))
            start = prompt.find(swap.source, start + 1)
        if not mine:
            shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
            raise EditError(f"{swap.source!r} does not occur in the prompt {shown!r} as a word of its own; the run-time "
                            f"edit replaces rows at the entity's positions, so the prompt must contain it")
        found.extend(mine[-1:] if which == "last" else mine)
    return found


def row_edit(occurrences: list[list[Occurrence]], layers, prompt_ids: torch.Tensor) -> RowEdit:
    """The `RowEdit` replacing the rows at the occurrences found in each prompt: a list per row of
    `prompt_ids` [b, L] (-1 at the padding), positions in a prompt counted from its first token."""
    reads = {}  # (row, position in the padded prompt) -> the (target id, weight) pairs read there; first wins
    for row, found in enumerate(occurrences):
        pad = int((prompt_ids[row] < 0).int().cumprod(0).sum())  # padding before the prompt (left padding)
        for occ in found:
            for position, read in zip(occ.positions, occ.row_map.reads):
                reads.setdefault((row, pad + position), read)
    k = max(len(r) for r in reads.values())
    target_ids = torch.tensor([[t for t, _ in r] + [r[0][0]] * (k - len(r)) for r in reads.values()])  # [n, k]
    weights = torch.tensor([[w for _, w in r] + [0.0] * (k - len(r)) for r in reads.values()], dtype=torch.float32)
    rows, positions = torch.tensor(list(reads)).T
    return RowEdit(prompt_ids, rows, positions, target_ids, weights, frozenset(layers))


@contextmanager
def runtime_edit(model, tokenizer, prompt: str | list[str], plan: EditPlan, occurrences: str = "all"):
    """Within the block, forwards of `prompt` (and generation from it) read the target's rows at the
    source's positions; yields the occurrences edited. Weights and input ids are untouched.

    `prompt` may be a list, a batch: padded as `tokenizer(prompts, padding=True)` pads it (to the
    longest prompt, on `tokenizer.padding_side`); every prompt must hold each source, and the block
    yields the occurrences of each."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise EditError("runtime_edit was given no prompt: pass a string, or a list of the batch's prompts")
    found = [find_occurrences(tokenizer, p, plan, occurrences) for p in prompts]
    if len(prompts) > 1 and tokenizer.pad_token is None:
        raise EditError("a batch of prompts is padded, and the tokenizer has no pad token: set tokenizer.pad_token "
                        "(e.g. to its EOS token) and pad the batch with it")
    batch = tokenizer(prompts, padding=len(prompts) > 1, return_attention_mask=True, return_tensors="pt")
    prompt_ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -1)  # [b, L], -1 at the padding
    if getattr(model.config, "stem_dense_first_token", False) and any(o.positions[0] == 0 for f in found for o in f):
        warnings.warn("an entity is the prompt's first token, which reads no row in this model (its STEM layers keep "
                      "the dense up-projection for a sequence's first token): the edit does not reach it there; put "
                      "a word before it to edit it", stacklevel=3)
    previous = model.stem_row_edit  # a nested block replaces it, and gives it back
    model.set_stem_row_edit(row_edit(found, plan.layers, prompt_ids))
    try:
        yield found[0] if isinstance(prompt, str) else found
    finally:
        model.set_stem_row_edit(previous)


# --- persistent ------------------------------------------------------------------------------------


def check_prompt(tokenizer, config, prompt: str, plan: EditPlan, occurrences: str, max_new_tokens: int) -> None:
    """The errors of `edit --prompt`, before any output: no occurrence to edit, or a continuation that passes the
    model's context."""
    find_occurrences(tokenizer, prompt, plan, occurrences)
    prompt_tokens, context = len(tokenizer(prompt)["input_ids"]), getattr(config, "max_position_embeddings", None)
    if context and prompt_tokens + max_new_tokens > context:
        raise EditError(f"--max-new-tokens: {max_new_tokens} new tokens after the prompt's {prompt_tokens} pass the "
                        f"model's context of {context}; give at most {max(context - prompt_tokens, 0)}")


def show_runtime_edit(source, tokenizer, prompt: str, plan: EditPlan, occurrences: str, max_new_tokens: int,
                      tables: str | None) -> str:
    """What `edit --prompt` prints: where the edit applies, and the prompt's greedy continuation before and with it."""
    model = model_from_source(source, stem_tables=tables)
    before = complete(model, tokenizer, prompt, max_new_tokens)
    with runtime_edit(model, tokenizer, prompt, plan, occurrences) as found:
        after = complete(model, tokenizer, prompt, max_new_tokens)
    where = "; ".join(f"{o.swap} at chars {o.chars[0]}-{o.chars[1]}, tokens {list(o.positions)}" for o in found)
    width = max(len("prompt"), len("after edit"))
    return "\n".join([f"edited: {where}"] + [f"{label:<{width}} | {text!r}" for label, text in
                                             (("prompt", prompt), ("before", before), ("after edit", after))])


def edited_rows(plan: EditPlan, read_parts, format_of) -> dict[int, tuple[torch.Tensor, dict, dict]]:
    """Per edited layer: (source ids [n], their stored rows now, their stored rows after the edit), each
    a dict of parts (`weight`; `qweight` and `scales` for a compressed table), every new row computed
    from the rows before the edit (so swaps in both directions exchange rows). A source that reads one
    target row takes that row's stored parts as they are (a compressed row with its scales); a mix of
    rows (`average`, padding) is decoded, summed and stored as the table stores rows.
    `read_parts(layer, ids)` gives a table's stored rows, `format_of(layer)` its `TableFormat`."""
    reads = plan.new_rows()
    sources = torch.tensor(sorted(reads))
    needed = sorted({t for r in reads.values() for t, _ in r} | set(reads))
    position = {token: i for i, token in enumerate(needed)}
    result = {}
    for layer in plan.layers:
        table_format = format_of(layer)
        parts = read_parts(layer, torch.tensor(needed))
        decoded = table_format.decode(parts, torch.float32)  # [len(needed), k]
        new = []
        for s in sources.tolist():
            if len(reads[s]) == 1 and reads[s][0][1] == 1.0:
                new.append({name: rows[position[reads[s][0][0]]] for name, rows in parts.items()})
            else:
                mixed = sum(w * decoded[position[t]] for t, w in reads[s])
                new.append({name: rows[0] for name, rows in table_format.encode(mixed[None]).items()})
        old = {name: rows[[position[s] for s in sources.tolist()]] for name, rows in parts.items()}
        result[layer] = (sources, old, {name: torch.stack([row[name] for row in new]) for name in parts})
    return result


def apply_edit(model, plan: EditPlan) -> dict:
    """Edit the tables of a loaded model (any placement); returns what `revert_edit` needs."""
    changes = edited_rows(plan, model.stem_table_parts, model.stem_table_format)
    for layer, (ids, _, new) in changes.items():
        model.set_stem_table_parts(layer, ids, new)
    return changes


def revert_edit(model, changes: dict) -> None:
    for layer, (ids, old, _) in changes.items():
        model.set_stem_table_parts(layer, ids, old)


def _write_rows(path: Path, table: StoredTable, part: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Write the stored rows `rows` [n, ...] of one part of a table at `ids` [n], into the file at `path`;
    a table stored in a group of layers (`config.stem_table_groups`) has its columns of the group's rows."""
    where = table.parts[part]
    first = (table.columns or (0,))[0] * where.dtype.itemsize  # bytes before this table's, in a stored row
    with open(path, "r+b") as f:
        for token, row in zip(ids.tolist(), rows.to(where.dtype)):
            f.seek(where.offset + token * where.row_bytes + first)
            f.write(row.contiguous().view(torch.uint8).numpy().tobytes())


def _record_keys(layer, part: str) -> tuple[str, str]:
    """(tensor name in an edit record, key of its file in the record's metadata) of one part of a
    layer's table. A float table's rows keep the names of the records written before compressed tables
    existed (`L.rows`, file key `L`), so those records still undo."""
    return (f"{layer}.rows", str(layer)) if part == "weight" else (f"{layer}.{part}", f"{layer}.{part}")


def _link_or_copy(src, dst) -> None:
    """Unchanged files are hard-linked (no bytes written), copied where linking cannot be done.
    Nothing here ever writes into a file in place, so a link cannot carry a change back to MODEL."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_edited_model(model_dir, out_dir, plan: EditPlan, tokenizer, command: str = "") -> dict:
    """A complete copy of the STEM model in `model_dir` at `out_dir` whose tables read the target's
    rows at the source's tokens. Shards without edited rows are linked (or copied); a shard with
    some is copied and those rows are overwritten in the copy. The rows replaced, config.json and
    README.md are kept in `out_dir/stem-edits/`, so that `undo_edits` restores the tables byte for
    byte without `model_dir`. Nothing appears at `out_dir` unless all of it was written."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    check_output(out_dir, model_dir)
    placed = stem_tables(open_source(str(model_dir)), plan.layers)
    tables = placed.stored
    changes = edited_rows(plan, placed.read_parts, lambda layer: tables[layer].format)
    edited_files = {Path(part.path).name for layer in changes for part in tables[layer].parts.values()}
    records = []

    def write(work: Path) -> None:
        shutil.copytree(model_dir, work, dirs_exist_ok=True, symlinks=False,
                        copy_function=lambda s, d: (shutil.copyfile if Path(s).name in edited_files and
                                                    Path(s).parent == model_dir else _link_or_copy)(s, d))
        for layer, (ids, _, new) in changes.items():
            for part, rows in new.items():
                _write_rows(work / Path(tables[layer].parts[part].path).name, tables[layer], part, ids, rows)
        records.append(_record_edit(work, config, plan, changes, tables, tokenizer, command))

    write_staged(out_dir, write)
    return records[0]


def check_output(out_dir, model_dir) -> None:
    """Refuse an output folder that holds anything, or lies inside MODEL, before anything is written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise EditError(f"{out_dir} exists and is not empty; choose a new directory for the edited model "
                        f"(an edit never modifies MODEL)")
    if out_dir.resolve().is_relative_to(Path(model_dir).resolve()):
        raise EditError(f"{out_dir} lies inside {model_dir}; write the edited model outside MODEL")


def _record_edit(folder: Path, config: dict, plan: EditPlan, changes: dict, tables, tokenizer, command: str) -> dict:
    """Keep the rows replaced (and the config and card as they were) in folder/stem-edits/, list the
    edit in config.json (`stem_edits`) and in the model card."""
    edits = list(config.get("stem_edits", []))
    record_name = f"{EDITS_FOLDER}/edit-{len(edits) + 1:03d}.safetensors"
    readme = folder / "README.md"
    tensors, files = {}, {}
    for layer, (ids, old, _) in changes.items():
        tensors[f"{layer}.ids"] = ids.clone()  # one ids tensor per layer
        for part, rows in old.items():
            name, key = _record_keys(layer, part)
            tensors[name], files[key] = rows.contiguous(), Path(tables[layer].parts[part].path).name
    for name in ("config.json", "README.md"):  # their bytes as they were, for an exact undo
        if (folder / name).exists():
            tensors[f"file.{name}"] = torch.tensor(list((folder / name).read_bytes()), dtype=torch.uint8)
    metadata = {"files": json.dumps(files)}
    (folder / EDITS_FOLDER).mkdir(exist_ok=True)
    save_file(tensors, folder / record_name, metadata=metadata)
    entry = {"swaps": [str(s) for s in plan.swaps], "mode": plan.mode, "layers": list(plan.layers),
             "tokens": [{"source": m.source.text, "source_ids": list(m.source.ids), "target": m.target.text,
                         "target_ids": list(m.target.ids), "mode": m.mode} for m in plan.maps],
             "rows_replaced": record_name, "command": command}
    config = {**config, "stem_edits": edits + [entry]}
    # Through a new file: config.json and README.md may be links to MODEL's, which must not change.
    _replace_bytes(folder / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    card = readme.read_text(encoding="utf-8", errors="replace") if readme.exists() else ""
    if "## Knowledge edits" not in card:
        card += ("\n## Knowledge edits\n\nThe tables of this model were edited by `stem-upcycle edit`: the rows of "
                 "the source tokens are the target's (in the STEM layers named). `stem-upcycle edit THIS_FOLDER "
                 "--undo` restores the tables as they were, byte for byte, from the rows kept in "
                 f"`{EDITS_FOLDER}/`.\n\n| # | swaps | mode | layers |\n|---|---|---|---|\n")
    card += f"| {len(edits) + 1} | {', '.join(entry['swaps'])} | {plan.mode} | {list(plan.layers)} |\n"
    _replace_bytes(readme, card.encode())
    return entry


def undo_edits(model_dir, out_dir=None) -> int:
    """Restore the tables, config.json and README.md of an edited model as they were before its
    first edit, from the records in stem-edits/ (the unedited model need not exist). In place when
    `out_dir` is None (each file replaced whole, never written into); else into a new `out_dir`.
    Returns the number of edits undone."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    edits = config.get("stem_edits") or []
    if not edits:
        raise EditError(f"{model_dir} records no edit (config.json has no stem_edits); nothing to undo")
    records = [model_dir / e["rows_replaced"] for e in edits]
    if missing := [r for r in records if not r.is_file()]:
        raise EditError(f"{missing[0]} is missing: the rows that edit replaced are gone, so it cannot be undone")
    if out_dir is not None:
        out_dir = Path(out_dir)
        check_output(out_dir, model_dir)

    def restore(target: Path) -> None:
        if target != model_dir:
            shutil.copytree(model_dir, target, dirs_exist_ok=True, copy_function=_link_or_copy,
                            ignore=lambda d, names: [EDITS_FOLDER] if Path(d) == model_dir else [])
        tables = stem_tables(open_source(str(model_dir))).stored
        touched = {}
        with ExitStack() as staged:  # every restored file renamed into place once all are written
            for record in reversed(records):  # the last edit first: each record holds the rows before it
                with safe_open(record, "pt") as f:
                    files = json.loads(f.metadata()["files"])
                    for key, name in files.items():
                        layer, _, part = key.partition(".")
                        if name not in touched:  # a fresh copy, so that a linked file is never written into
                            touched[name] = staged.enter_context(staged_file(target / name))
                            shutil.copyfile(model_dir / name, touched[name])
                        part = part or "weight"
                        _write_rows(touched[name], tables[int(layer)], part, f.get_tensor(f"{layer}.ids"),
                                    f.get_tensor(_record_keys(layer, part)[0]))
        with safe_open(records[0], "pt") as f:  # config and card as they were before the first edit
            for name in ("config.json", "README.md"):
                if f"file.{name}" in f.keys():
                    _replace_bytes(target / name, f.get_tensor(f"file.{name}").numpy().tobytes())
                else:
                    (target / name).unlink(missing_ok=True)
        shutil.rmtree(target / EDITS_FOLDER, ignore_errors=True)  # last: an interrupted undo can be run again

    restore(model_dir) if out_dir is None else write_staged(out_dir, restore)
    return len(edits)


def _replace_bytes(path: Path, data: bytes) -> None:
    """Write `path` as a new file (never into the old one, which may be a link to MODEL's)."""
    with staged_file(path) as partial:
        partial.write_bytes(data)
