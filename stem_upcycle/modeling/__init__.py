"""The STEM model classes; these two files are copied next to exported weights."""

from .configuration_stem import StemConfig
from .modeling_stem import StemForCausalLM, StemMLP, StemModel, StemPreTrainedModel

__all__ = ["StemConfig", "StemForCausalLM", "StemMLP", "StemModel", "StemPreTrainedModel"]
