"""STEM models for Hugging Face Transformers.

A STEM model is the dense family's own model (Llama, Qwen3, Gemma2, ...) in which the MLP of some
decoder layers computes ``down_proj(act(gate_proj(x)) * up_table[token_id])``: the up-projection is
replaced by a per-layer table with one row per vocabulary entry.

One mechanism serves every family: ``StemForCausalLM(config)`` builds a subclass of the dense
family's class (``StemLlamaForCausalLM``, ...) that differs in one place, the MLPs of the STEM
layers. Everything else (attention, caches, logit soft-capping, weight tying, gradient
checkpointing, generation) is the family's own code.

Exported next to the weights, so it imports only torch and transformers.
"""

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.models.auto import modeling_auto
import transformers

from .configuration_stem import StemConfig


class TokenIds:
    """The input ids of the current forward, shared by the STEM MLPs of one model.

    Decoder layers hand only hidden states to their MLP; the ids are stashed here by a forward
    pre-hook on the base model and read by each STEM MLP (also when gradient checkpointing
    recomputes a layer during backward, which happens before the next forward replaces them).
    """

    def __init__(self):
        self.ids = None


class StemMLP(nn.Module):
    """Gated MLP whose up-projection is a lookup: down(act(gate(x)) * up_table[ids])."""

    def __init__(self, config: StemConfig, token_ids: TokenIds):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.stem_mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.stem_mlp_bias)
        self.up_table = nn.Embedding(config.vocab_size, config.intermediate_size)
        self.act_fn = ACT2FN[config.stem_activation]
        self.token_ids = token_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.token_ids.ids  # [batch, seq]
        if ids is None or ids.shape != x.shape[:-1]:
            raise RuntimeError(
                "STEM MLP called without matching input ids; call the model with input_ids so that "
                "its STEM layers can look up their table rows"
            )
        up = self.up_table(ids).to(x.dtype)  # [batch, seq, d_ff]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * up)  # [batch, seq, d]


def _stash_input_ids(module, args, kwargs):
    """Forward pre-hook of the base model: check the ids and hand them to the STEM MLPs."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ValueError(
            "STEM layers look up table rows by token id: pass input_ids (inputs_embeds alone "
            "cannot be used with a STEM model)"
        )
    vocab = module.config.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"input_ids must lie in [0, {vocab - 1}] (the STEM tables have {vocab} rows); "
            f"got values from {int(ids.min())} to {int(ids.max())}"
        )
    module.stem_token_ids.ids = ids


class _StemDispatch:
    """Turns ``StemX(config)`` into an instance of a STEM subclass of the dense family's class.

    Subclasses set ``_dense_mapping``: the Transformers table from model_type to class name.
    """

    _dense_mapping: dict = {}
    _family_classes: dict = {}

    @classmethod
    def family_class(cls, dense_model_type: str) -> type:
        """The STEM subclass of the dense family's class, created once per family."""
        if not cls._is_dispatcher():
            return cls
        key = (cls.__name__, dense_model_type)
        if key not in _StemDispatch._family_classes:
            if dense_model_type not in cls._dense_mapping:
                raise ValueError(f"no {cls.__name__} for dense model type {dense_model_type!r}")
            dense_cls = getattr(transformers, cls._dense_mapping[dense_model_type])
            name = "Stem" + dense_cls.__name__
            family_cls = type(name, (cls, dense_cls), {"__module__": __name__, "config_class": StemConfig})
            globals()[name] = family_cls  # importable by name, so that instances pickle
            _StemDispatch._family_classes[key] = family_cls
        return _StemDispatch._family_classes[key]

    @classmethod
    def _is_dispatcher(cls) -> bool:
        return "_dense_mapping" in cls.__dict__

    def __new__(cls, config=None, *args, **kwargs):
        if config is not None and cls._is_dispatcher():
            cls = cls.family_class(config.dense_model_type)
        return super().__new__(cls)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
        if cls._is_dispatcher():
            if not isinstance(config, StemConfig):
                hub_keys = ("cache_dir", "local_files_only", "revision", "token", "subfolder")
                config = StemConfig.from_pretrained(
                    pretrained_model_name_or_path, **{k: kwargs[k] for k in hub_keys if k in kwargs}
                )
            cls = cls.family_class(config.dense_model_type)
        return super(_StemDispatch, cls).from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        return super(_StemDispatch, cls.family_class(config.dense_model_type))._from_config(config, **kwargs)

    def post_init(self):
        # Difference from the dense family: before the usual post-init (weight init, tying), the
        # MLPs of the STEM layers are replaced and the id hook is installed on the base model.
        base = self.base_model
        base.stem_token_ids = TokenIds()
        for index in self.config.stem_layers:
            base.layers[index].mlp = StemMLP(self.config, base.stem_token_ids)
        base.register_forward_pre_hook(_stash_input_ids, with_kwargs=True)
        super().post_init()


class StemPreTrainedModel(_StemDispatch, PreTrainedModel):
    config_class = StemConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True


class StemModel(StemPreTrainedModel):
    """The STEM decoder without LM head (a subclass of the dense family's base model)."""

    _dense_mapping = modeling_auto.MODEL_MAPPING_NAMES


class StemForCausalLM(StemPreTrainedModel, GenerationMixin):
    """The STEM causal LM (a subclass of the dense family's ...ForCausalLM)."""

    _dense_mapping = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


__all__ = ["StemPreTrainedModel", "StemModel", "StemForCausalLM", "StemMLP"]
