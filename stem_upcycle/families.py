"""What stem-upcycle knows about each dense architecture, in one declarative table.

A family names, for its decoder layers, the tensors of the gated MLP and of the norm in front of
it, and the details of how the MLP's input relates to the input embedding (norm offset,
embedding scale). Conversion, initialisation and `inspect` read only this table.
"""

from dataclasses import dataclass

from .errors import UserError


@dataclass(frozen=True)
class Family:
    """Tensor names and numerics of one family of gated-MLP decoders.

    Names are relative to `model.layers.{i}.`; `{i}` is the layer index.
    """

    model_types: tuple[str, ...]
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    # Phi-3 keeps gate and up in one matrix, gate rows first; it is split at conversion.
    fused_gate_up: str | None = None
    # Norm applied to the residual stream right before the MLP; None for post-norm families
    # (OLMo2), whose MLP reads the raw residual stream.
    pre_mlp_norm: str | None = "post_attention_layernorm"
    # Gemma stores RMSNorm weights as w and applies (1 + w).
    norm_offset: float = 0.0
    # How input embeddings are scaled before layer 0: None, "sqrt_hidden" (Gemma) or the name of a
    # config attribute holding the multiplier (Granite's "embedding_multiplier").
    embed_scale: str | None = None
    # Config attribute naming the gate activation.
    activation_attr: str = "hidden_act"


LAYER_PREFIX = "model.layers.{i}."
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
STEM_TABLE_PREFIX = "mlp.up_table"  # a table's tensors: .weight (float rows) or .qweight and .scales (table_format.py)
STEM_TABLE = STEM_TABLE_PREFIX + ".weight"
STEM_GATE = "mlp.gate_proj"
STEM_UP = "mlp.up_proj"  # the table columns' up rows, kept for the sequences' first tokens (`--first-token dense`)
STEM_UP_REST = "mlp.up_rest"  # the up rows of the neurons that are no table columns (`--columns`)
STEM_NEURON_ORDER = "mlp.neuron_order"  # the parent's index of each of a STEM MLP's neurons (`--columns`)

FAMILIES = (
    Family(("llama", "mistral", "qwen2", "qwen3")),
    Family(("granite",), embed_scale="embedding_multiplier"),
    Family(("gemma",), norm_offset=1.0, embed_scale="sqrt_hidden"),
    Family(
        ("gemma2", "gemma3_text"),
        pre_mlp_norm="pre_feedforward_layernorm",
        norm_offset=1.0,
        embed_scale="sqrt_hidden",
        activation_attr="hidden_activation",
    ),
    Family(("olmo2",), pre_mlp_norm=None),
    Family(("phi3",), gate="", up="", fused_gate_up="mlp.gate_up_proj"),
)

SUPPORTED = tuple(t for f in FAMILIES for t in f.model_types)


class UnsupportedArchitecture(UserError):
    pass


def family_for(model_type: str) -> Family:
    """The family of a dense `model_type`, or a one-line error naming the supported ones."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type == "stem":
        raise UnsupportedArchitecture("the source is already a STEM model; convert its dense base instead")
    raise UnsupportedArchitecture(
        f"model type {model_type!r} is not supported: STEM needs a gated MLP (gate_proj, up_proj, "
        f"down_proj) in every decoder layer and no experts; supported: {', '.join(SUPPORTED)}"
    )


def layer_name(i: int, suffix: str) -> str:
    return LAYER_PREFIX.format(i=i) + suffix


def embed_multiplier(family: Family, config) -> float:
    """Factor applied to looked-up embeddings before layer 0."""
    if family.embed_scale is None:
        return 1.0
    if family.embed_scale == "sqrt_hidden":
        return float(config.hidden_size) ** 0.5
    return float(getattr(config, family.embed_scale))
