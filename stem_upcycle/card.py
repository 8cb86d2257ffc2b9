"""The README model card written next to a converted model (huggingface_hub's ModelCard and its metadata)."""

from huggingface_hub import ModelCard, ModelCardData

from .summary import describe_widths
from .table_init import INITIALISERS

UNTRAINED_WARNING = (
    "A converted STEM model, not yet trained, is worse than its dense base, by how much depends on the layers "
    "converted and the table init. Measured on SmolLM2-135M-Instruct: convert's defaults (a sixth of every layer's "
    "neurons, rows from the parent) give 1.27x-1.80x the parent's perplexity on eight held-out genres, 41 of its 53 "
    "facts; layer 0 alone with --init calib is usable as it is (1.00x-1.01x on six genres, 48 facts); no model "
    "made with the data-free closed-form init is. Recovery training (`stem-upcycle train`) closes part of the gap; "
    "measure this model against its base with `stem-upcycle eval MODEL --data FILE --reference BASE --facts`."
)
# The card's line before UNTRAINED_WARNING; recovery training (training/export.py) rewrites it.
UNTRAINED_HEADING = "> **Converted, not trained.**"


def model_card(plan, command: str) -> str:
    license_ = plan.source.license or "unknown: check the base model's licence"
    # The hub reads base_model as a repository id: set only when the source is known to come from one.
    data = ModelCardData(base_model=plan.source.hub_id, library_name="transformers",
                         license=plan.source.license or "other", tags=["stem", "stem-upcycle", plan.config.dense_model_type])
    return ModelCard(f"---\n{data.to_yaml()}\n---\n" + _body(plan, command, license_)).content


def _replaced(plan) -> str:
    """Which of a STEM layer's up-projection the table replaced, in words."""
    if not plan.columns:
        return ""
    return (" of some of its intermediate neurons (the table's columns, ordered first; `up_rest` keeps the others' "
            "dense: `down_proj(act(gate_proj(x)) * cat(up_table[token_id], up_rest(x)))`)")


def _revision(source) -> str:
    """The commit of a base model fetched from (or found in the cache of) the Hub."""
    return f" at commit `{source.revision}` of [{source.hub_id}](https://huggingface.co/{source.hub_id})" \
        if source.revision and source.hub_id else ""


def _body(plan, command: str, license_: str) -> str:
    cfg = plan.config
    return f"""
# STEM model upcycled from `{plan.source.spec}`

A STEM model (Scaling Transformers with Embedding Modules, arXiv 2601.10639) made by
[stem-upcycle](https://pypi.org/project/stem-upcycle/) from a dense `{cfg.dense_model_type}` checkpoint.
In the STEM layers the MLP computes `down_proj(act(gate_proj(x)) * up_table[token_id])`: the dense
up-projection{_replaced(plan)} is replaced by a table with one row per vocabulary entry.

| | |
|---|---|
| base model | `{plan.source.spec}`{_revision(plan.source)} |
| licence of the base model | {license_} |
| STEM layers | {len(plan.layers)} of {cfg.num_hidden_layers}: {plan.layers} |
| table init | `{plan.init}`: {INITIALISERS[plan.init].description} |
| table columns | {plan.describe_columns()} |
| tables | {len(plan.layers)} x [{cfg.vocab_size}, {describe_widths(cfg)}], {plan.table_format.describe()}: {plan.table_bytes / 1e9:.2f} GB |
| first token | {"dense up-projection (kept for each sequence's first token)" if cfg.stem_dense_first_token else "its table row"} |
| weights | {plan.total_bytes / 1e9:.2f} GB in {len(plan.shards)} safetensors shard(s) |
| made with | `{command or "stem_upcycle.convert"}` |

{UNTRAINED_HEADING} {UNTRAINED_WARNING}

## Loading

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH")
```

`trust_remote_code=True` runs `configuration_stem.py` and `modeling_stem.py` from this directory
(they import only torch and transformers); with `import stem_upcycle` it is not needed. The STEM
layers need token ids: call the model with `input_ids`, not `inputs_embeds`.
"""
