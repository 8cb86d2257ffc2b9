"""The STEM model classes. Every module of this package is copied next to exported weights (`convert.MODELING_FILES`),
so that a model loads with `trust_remote_code=True` where stem-upcycle is not installed: they import only torch,
transformers and the standard library."""

from .configuration_stem import StemConfig
from .modeling_stem import StemForCausalLM, StemMLP, StemModel, StemPreTrainedModel

__all__ = ["StemConfig", "StemForCausalLM", "StemMLP", "StemModel", "StemPreTrainedModel"]
