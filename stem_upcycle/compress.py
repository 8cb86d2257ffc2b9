"""Store the tables of an existing STEM model in another format: compress them (int8, float8, int4 with
per-block scales, `modeling/table_format.py`) or decompress them (float32, bfloat16, float16); and lay
float tables out one tensor per layer, or in groups of layers whose rows of a token lie side by side
(`config.stem_table_groups`: a cold forward reads a token's rows of a group in one read, not one per
layer; benchmarks/README.md, row_layout.py).

Out of core, like `convert`: the dense tensors are copied one at a time, each table is read in chunks
of rows (decoded from its format), encoded and written as it goes; the new model is written beside OUT
and moved into place only when complete. The exported modeling code is refreshed, since older copies
cannot read compressed tables.
"""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .convert import (MODELING_DIR, MODELING_FILES, ConversionError, Copy, Table, TableGroup, check_blocks,
                      check_output, chunk_rows, parse_shard_size, resolve_table_format, table_group_name, table_groups,
                      tensor_order_key, write_tensors)
from .atomic import write_staged
from .families import STEM_TABLE_PREFIX, layer_name
from .loading import stem_tables
from .modeling.configuration_stem import table_columns
from .modeling.table_files import is_table_tensor
from .modeling.table_format import TableFormat
from .shards import INDEX_NAME, TensorSpec, plan_shards
from .source import Source
from .summary import describe_widths, table_layout


@dataclass
class CompressionPlan:
    source: Source
    old: dict  # layer -> the table's current TableFormat
    new: TableFormat
    groups: list | None  # the new `config.stem_table_groups`; None: a tensor per table
    specs: list[TensorSpec]
    producers: dict  # output name -> Copy | Table | TableGroup
    shards: list

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def table_bytes(self) -> tuple[int, int]:
        """(bytes of the tables now, bytes of them in the new format)."""
        now = sum(self.source.tensors.nbytes(n) for n in self.source.tensors.names() if is_table_tensor(n))
        return now, sum(s.nbytes for s in self.specs if isinstance(self.producers[s.name], (Table, TableGroup)))

    def describe(self) -> str:
        cfg = self.source.config
        before, after = self.table_bytes()
        olds = sorted({f.describe() for f in self.old.values()})
        return "\n".join([
            f"model      {self.source.spec} ({len(self.old)} STEM tables of [{cfg.vocab_size}, {describe_widths(cfg)}])",
            f"tables     {' / '.join(olds)} -> {self.new.describe()}",
            f"layout     {table_layout(self.source.config.stem_table_groups)} -> {table_layout(self.groups)}",
            f"table bytes {_size(before)} -> {_size(after)} ({after / before:.3f}x)",
            f"output     {_size(self.total_bytes)} in {len(self.shards)} shard(s) (the model now: "
            f"{_size(self.source.files_bytes)})",
        ])


def _size(count: int) -> str:
    return f"{count / 1e9:.3f} GB" if count >= 1e9 else f"{count / 1e6:.3f} MB"


def plan_compression(source: Source, table_dtype: str | None, block_size: int | None = None,
                     max_shard_size: str | int = "5GB", layer_groups: int | None = None) -> CompressionPlan:
    """The new model's tensors: tables in the format of `table_dtype` (None: as they are now), a tensor per
    table (`layer_groups` 1) or in groups of `layer_groups` consecutive STEM layers (None: as now)."""
    cfg = source.config
    if getattr(cfg, "model_type", None) != "stem" or not getattr(cfg, "stem_layers", None):
        raise ConversionError(f"{source.spec} is not a STEM model; convert it first (`stem-upcycle convert`), with "
                              f"--table-dtype to store its tables compressed")
    if getattr(cfg, "stem_edits", None):
        raise ConversionError(f"{source.spec} carries knowledge edits, whose undo records hold rows in the tables' "
                              f"current format; undo them first (`stem-upcycle edit {source.spec} --undo OUT`)")
    placed = stem_tables(source)
    old = {layer: table.format for layer, table in placed.stored.items()}
    if table_dtype is None and len(set(old.values())) > 1:
        raise ConversionError(f"the tables of {source.spec} are stored in several formats; give --table-dtype")
    widths = {layer: table_columns(cfg, layer) for layer in cfg.stem_layers}
    new = next(iter(old.values())) if table_dtype is None else resolve_table_format(table_dtype, block_size, None)
    check_blocks(new, widths)  # each table's rows split into the format's blocks
    groups = _new_groups(source, new, layer_groups)
    if all(f == new for f in old.values()) and groups == cfg.stem_table_groups:
        raise ConversionError(f"the tables of {source.spec} are already {new.describe()}, stored as "
                              f"{table_layout(groups)}; nothing to do")
    tensors, vocab, d_ff = source.tensors, cfg.vocab_size, cfg.intermediate_size
    placed_at = {}  # output name -> (sort key, spec, producer): every table where its layer's tensors are
    for name in tensors.names():
        if not is_table_tensor(name):
            placed_at[name] = (tensor_order_key(name), TensorSpec(name, tuple(tensors.shape(name)), tensors.dtype(name)),
                               Copy(name))
    for k, group in enumerate(groups or []):
        out = table_group_name(k)
        key = tensor_order_key(layer_name(group[0], STEM_TABLE_PREFIX + ".weight"))  # where its first table was
        placed_at[out] = (key, TensorSpec(out, (vocab, sum(widths[i] for i in group)), new.parts(d_ff)["weight"][1]),
                          TableGroup(tuple(group)))
    for layer in cfg.stem_layers if not groups else []:
        for part, (width, dtype) in new.parts(widths[layer]).items():
            out = layer_name(layer, f"{STEM_TABLE_PREFIX}.{part}")
            placed_at[out] = (tensor_order_key(out), TensorSpec(out, (vocab, width), dtype), Table(layer, part))
    ordered = sorted(placed_at.values(), key=lambda entry: entry[0])
    specs, producers = [spec for _, spec, _ in ordered], {spec.name: producer for _, spec, producer in ordered}
    return CompressionPlan(source, old, new, groups, specs, producers,
                           plan_shards(specs, parse_shard_size(max_shard_size)))


def _new_groups(source: Source, new: TableFormat, layer_groups: int | None) -> list | None:
    """The new `config.stem_table_groups`: `layer_groups` consecutive STEM layers each (1: none), or as now
    (None; compressed tables are stored a tensor per table)."""
    if layer_groups is None:
        return None if new.compressed else source.config.stem_table_groups
    return table_groups(source.config.stem_layers, layer_groups, new)


def run_compression(plan: CompressionPlan, out: Path, overwrite: bool = False, progress: bool = True,
                    command: str = "") -> Path:
    """Write the model with its tables in the new format to OUT; nothing appears at OUT unless complete."""
    out = Path(out)
    check_output(out, overwrite, plan.source, plan.total_bytes)
    if any(f.compressed for f in plan.old.values()) and plan.new.compressed:
        print(f"note: the tables are compressed already; re-encoding them as {plan.new.dtype} adds its error to "
              f"theirs: compress the float model for the best rows", file=sys.stderr)
    placed = stem_tables(plan.source)
    cfg = plan.source.config
    d_ff, widths = cfg.intermediate_size, {layer: table_columns(cfg, layer) for layer in cfg.stem_layers}

    def table_rows(layer):
        return lambda start, stop, chunk: chunk.copy_(placed.read_range(layer, start, stop))

    def write(staging: Path) -> None:
        write_tensors(plan.specs, plan.producers, plan.shards, plan.source.tensors, table_rows, plan.new, widths,
                      chunk_rows(d_ff), staging, progress)
        _write_side_files(plan, staging, command)

    return write_staged(out, write)


def _write_side_files(plan: CompressionPlan, directory: Path, command: str) -> None:
    """The model's other files as they are, with config.json naming the new format, the current modeling
    code, and a line in the model card."""
    folder = plan.source.directory
    for path in folder.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX_NAME:
            shutil.copyfile(path, directory / path.name)
    for name in MODELING_FILES:
        shutil.copyfile(MODELING_DIR / name, directory / name)
    config = json.loads((folder / "config.json").read_text())
    config.pop("stem_table_format", None)
    if plan.new.compressed:
        config["stem_table_format"] = plan.new.to_config()
    config.pop("stem_table_groups", None)
    if plan.groups:
        config["stem_table_groups"] = plan.groups
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = directory / "README.md"
    text = card.read_text(encoding="utf-8") if card.exists() else ""
    before, after = plan.table_bytes()
    text += (f"\n## Table format\n\nThe tables are stored as {plan.new.describe()}, {table_layout(plan.groups)} "
             f"({after / 1e9:.2f} GB, {after / before:.3f}x of before), made with "
             f"`{command or 'stem_upcycle.compress'}`.\n")
    card.write_text(text, encoding="utf-8")
