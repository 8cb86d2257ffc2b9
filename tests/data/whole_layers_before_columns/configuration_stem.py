"""Configuration of a STEM model: the dense model's configuration plus which layers are STEM.

Exported next to the weights, so it imports only transformers.
"""

from transformers import PretrainedConfig


class StemConfig(PretrainedConfig):
    """A dense decoder's configuration, flat, with the STEM fields added.

    Every attribute of the dense configuration (hidden_size, rope parameters, layer types, ...) is
    kept as it was, so the dense family's modeling code reads this object unchanged.

    Args:
        dense_model_type: `model_type` of the dense family the layers come from ("llama", "qwen3", ...).
        stem_layers: indices of the decoder layers whose up-projection is replaced by a table.
        stem_init: how the tables were initialised ("closed-form", ...); informational.
        stem_activation: name in `transformers.activations.ACT2FN` of the gate activation.
        stem_mlp_bias: whether gate_proj and down_proj of a STEM layer carry a bias.
        stem_dense_first_token: whether each sequence's first token keeps the dense up-projection
            (`up_proj`, kept in every STEM layer for that token alone) instead of its table row; see
            `StemMLP`.
        stem_tables: where `from_pretrained` puts the tables: "memory" (parameters), "mmap" (rows read from
            the checkpoint files with `pread` as forwards need them), "host" (host memory with a row cache on the accelerator);
            None: "mmap" when the checkpoint is in safetensors files, else "memory". A keyword of
            `from_pretrained` overrides it.
        stem_cache_rows: rows (token ids) the "host" placement caches on the device.
        stem_table_format: how compressed tables store their rows, {"dtype": "int8" | "float8" | "int4",
            "block_size": elements per float16 scale} (`table_format.py`); None: float rows, in the
            dtype their files hold.
        stem_table_groups: STEM layers whose tables are stored side by side, a list of lists of layers:
            a token's rows of a group's layers lie next to each other, in one tensor
            `model.stem_table_groups.K.weight` [vocab, len(group) x intermediate_size], so that a
            forward reads them in one read, not one per layer (`stem-upcycle convert --layer-groups`, 5 by
            default); "memory" and "host" read each layer's columns. None: each table its own tensor.
    """

    model_type = "stem"
    # Where `from_pretrained(..., stem_tables=..., stem_cache_rows=...)` put the tables: set on the loaded config,
    # they are choices of that load, not properties of the checkpoint, and are written at these defaults.
    load_time_defaults = {"stem_tables": None, "stem_cache_rows": 2048}

    def __init__(
        self,
        dense_model_type: str = "llama",
        stem_layers: list | tuple = (),
        stem_init: str | None = None,
        stem_activation: str = "silu",
        stem_mlp_bias: bool = False,
        stem_dense_first_token: bool = False,
        stem_tables: str | None = None,
        stem_cache_rows: int = 2048,
        stem_table_format: dict | None = None,
        stem_table_groups: list | None = None,
        **kwargs,
    ):
        self.dense_model_type = dense_model_type
        self.stem_layers = sorted(int(i) for i in stem_layers)
        self.stem_init = stem_init
        self.stem_activation = stem_activation
        self.stem_mlp_bias = bool(stem_mlp_bias)
        self.stem_dense_first_token = bool(stem_dense_first_token)
        self.stem_tables = stem_tables
        self.stem_cache_rows = int(stem_cache_rows)
        self.stem_table_format = stem_table_format
        self.stem_table_groups = [[int(i) for i in group] for group in stem_table_groups] if stem_table_groups else None
        super().__init__(**kwargs)

    def save_pretrained(self, *args, **kwargs):
        # Difference from PretrainedConfig: the load-time choices are saved at their defaults, so that a model
        # loaded with stem_tables="memory" (as saving needs) and saved loads as any other, not in memory.
        chosen = {key: getattr(self, key) for key in self.load_time_defaults}
        for key, value in self.load_time_defaults.items():
            setattr(self, key, value)
        try:
            return super().save_pretrained(*args, **kwargs)
        finally:
            for key, value in chosen.items():
                setattr(self, key, value)
