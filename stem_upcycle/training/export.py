"""Write the trained model exactly as `convert` writes a STEM model.

The tensor names, shapes, order and shard layout are those of the converted starting point (`W_up`
in the STEM layers only for the first token, if kept; LoRA merged), the dtype that of the source unless the recipe says; the
side files (config, modeling code, tokenizer, generation config) are copied from it, and the model
card gains a training section. Files are
staged in a hidden directory and moved into OUTPUT only when all are written, config.json last.
"""

import json
import os
import shutil
from functools import partial
from pathlib import Path

import torch

from ..convert import resolve_dtype, side_by_side, table_group_name, tensor_order_key
from ..modeling.table_files import checkpoint_files, read_header
from ..families import STEM_TABLE, layer_name
from ..atomic import staging_dir
from ..card import UNTRAINED_HEADING
from ..shards import INDEX_NAME, ShardWriter, TensorSpec, plan_shards
from ..source import open_source

MAX_SHARD_BYTES = 5 * 10**9  # convert's default --max-shard-size
ROWS_PER_WRITE = 4096  # rows of a group of tables joined at once


def write_model(out: Path, init_dir: Path, source, recipe, tables: dict, state: dict, tokens_seen: int,
                datasets: dict | None = None) -> Path:
    """Write the trained model into `out`, laid out as the converted `init_dir`; `tables`: {layer: [vocab, k]},
    `state`: the dense weights by name; `datasets`: the Hub datasets it trained on ({entry: hub_datasets.Resolved}),
    named with their commits in the config (`stem_training_data`) and the card.

    Floating-point tensors are written in `model.export_dtype` (auto: the source checkpoint's dtype, so
    that a bf16 model does not come back in the fp32 its training copy was converted to)."""
    init = open_source(str(init_dir))
    dtype = resolve_dtype(recipe.model.export_dtype, source)
    groups = {table_group_name(k): group for k, group in enumerate(getattr(init.config, "stem_table_groups", None) or [])}
    # the tables of a group side by side, as `convert` stores them, a few rows at a time: joined whole, a group of
    # Llama-3.2-1B tables would take 21 GB at once
    group_rows = {name: side_by_side([partial(_copy_rows, tables[i]) for i in group],
                                     [tables[i].shape[1] for i in group]) for name, group in groups.items()}
    shapes = {name: (tables[group[0]].shape[0], sum(tables[i].shape[1] for i in group)) for name, group in groups.items()}
    tables = {layer_name(i, STEM_TABLE): t for i, t in tables.items()}
    specs = []
    for name in stored_order(init):
        value = tables.get(name, state.get(name))
        shape = shapes.get(name, None if value is None else tuple(value.shape))
        if shape is None or shape != init.tensors.shape(name):
            raise RuntimeError(f"the trained model has no tensor {name} shaped like the converted one")
        stored = init.tensors.dtype(name)
        specs.append(TensorSpec(name, init.tensors.shape(name), dtype if stored.is_floating_point else stored))
    staging = staging_dir(out, ".export")
    try:
        writer = ShardWriter(staging, plan_shards(specs, MAX_SHARD_BYTES))
        for spec in specs:
            if spec.name in group_rows:
                for start in range(0, spec.shape[0], ROWS_PER_WRITE):
                    rows = torch.empty(min(ROWS_PER_WRITE, spec.shape[0] - start), spec.shape[1], dtype=spec.dtype)
                    group_rows[spec.name](start, start + rows.shape[0], rows)
                    writer.write(spec.name, rows)
            else:
                writer.write(spec.name, tables.get(spec.name, state.get(spec.name)).detach().to("cpu", spec.dtype))
        writer.close()
        for path in init.directory.iterdir():  # the model's other files; a trained init_from's run files are its own
            if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX_NAME, *RUN_FILES):
                shutil.copyfile(path, staging / path.name)
        _set_config(staging / "config.json", dtype, recipe, datasets or {})
        _add_training_card(staging / "README.md", out / "train_log.jsonl", recipe, tokens_seen, datasets or {})
        names = sorted((p.name for p in staging.iterdir()), key=lambda n: n == "config.json")  # config last
        for name in names:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


DATASETS_FILE = "datasets.json"  # the Hub datasets' files a run chose ({entry: Resolved.record()}): a resume reads them
# What a training run writes into its output beside the model: never copied from the model it started from
RUN_FILES = ("recipe.yaml", "train_log.jsonl", DATASETS_FILE)


def stored_order(init) -> list[str]:
    """The checkpoint's tensor names in the order their bytes lie, shard after shard: the order `convert`
    wrote them in (a table, or a group's, after its first layer's other tensors); a checkpoint of other
    files (a dense `model.init_from` as .bin): embedding, layers, head."""
    files = checkpoint_files(str(init.directory), {})
    if files is None:
        return sorted(init.tensors.names(), key=tensor_order_key)
    offset = {}
    for path in sorted(set(files.values())):
        header, _ = read_header(path)
        offset.update({name: (path, entry["data_offsets"][0]) for name, entry in header.items() if name in files})
    return sorted(files, key=offset.__getitem__)


def _copy_rows(table: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """A table's rows start..stop-1 into `out`: a layer's `fill` for `side_by_side`."""
    out.copy_(table[start:stop].detach())


def _fitted_on(recipe, datasets: dict) -> tuple[list, list]:
    """([the Hub datasets the model was trained or calibrated on], [those it was only scored on])."""
    fitted = set(recipe.data.train_sources()) | set(recipe.model.calib_data)
    return ([r for entry, r in datasets.items() if entry in fitted],
            [r for entry, r in datasets.items() if entry not in fitted])


def _set_config(config: Path, dtype, recipe, datasets: dict) -> None:
    """The config names the weights' dtype (`dtype`, `torch_dtype` before Transformers 5): the exported one; and
    the Hub datasets trained or calibrated on (`stem_training_data`) and scored on (`stem_eval_data`), each with its
    commit and the files read."""
    fields = json.loads(config.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in [k for k in ("dtype", "torch_dtype") if k in fields] or ["dtype"]:
        fields[key] = name
    for key, resolved in zip(("stem_training_data", "stem_eval_data"), _fitted_on(recipe, datasets)):
        if resolved:
            fields[key] = [{k: r.record()[k] for k in ("dataset", "revision", "glob", "files")} for r in resolved]
    config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def _add_training_card(card: Path, log: Path, recipe, tokens_seen: int, datasets: dict) -> None:
    evals = [r for r in map(json.loads, log.read_text().splitlines()) if "eval" in r] if log.exists() else []

    def named(entry: str) -> str:
        if entry not in datasets:
            return entry
        r = datasets[entry]
        return (f"[{r.spec.repo}]({_hub_page(r.spec.repo)}) at commit `{r.commit}` ({len(r.files)} of its "
                f"{r.matching} files{' matching ' + r.spec.glob if r.spec.glob else ''})")

    data = ", ".join(map(named, recipe.data.train_sources())) or "no text of the user's"
    if recipe.generated.tokens:
        data += (f" and {recipe.generated.tokens} tokens sampled from `{recipe.model.source}` itself "
                 f"({recipe.generated.train_share:.0%} of each batch)")
    lines = [
        "\n## Recovery training (stem-upcycle train)\n",
        f"Trained {recipe.train.steps} steps, {tokens_seen} tokens, on {data}; "
        f"trainable: {', '.join(recipe.train.trainable)}; losses: {recipe.loss.kd_weight} x KL to `{recipe.model.source}` "
        f"+ {recipe.loss.ce_weight} x cross-entropy. The recipe as run is in the training output (`recipe.yaml`).\n\n",
    ]
    if evals:
        first, last = evals[0]["eval"], evals[-1]["eval"]
        lines += ["| held-out set | tokens | dense model | before training | after | after / dense |\n",
                  "|---|---|---|---|---|---|\n"]
        lines += [f"| {name} | {e['tokens']} | {e['ref_ppl']:.2f} | {first[name]['ppl']:.2f} | {e['ppl']:.2f} | "
                  f"{e['ppl_ratio']:.2f}x |\n" for name, e in last.items()]
    text = card.read_text() if card.exists() else ""
    text = text.replace(UNTRAINED_HEADING, "> At conversion, before training:")
    card.write_text(text + "".join(lines))
    if fitted := _fitted_on(recipe, datasets)[0]:  # the card's metadata names them, as the Hub lists a model's data
        from huggingface_hub import ModelCard

        model_card = ModelCard.load(card)
        model_card.data.datasets = sorted({r.spec.repo for r in fitted})
        model_card.save(card)


def _hub_page(repo: str) -> str:
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/datasets/{repo}"
