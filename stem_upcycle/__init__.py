"""stem-upcycle: turn a dense Hugging Face causal LM into a STEM model.

Importing the package registers the STEM classes with AutoConfig, AutoModel and
AutoModelForCausalLM, so converted checkpoints load without trust_remote_code.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .modeling import StemConfig, StemForCausalLM, StemMLP, StemModel

__version__ = "0.1.0"

AutoConfig.register(StemConfig.model_type, StemConfig, exist_ok=True)
AutoModel.register(StemConfig, StemModel, exist_ok=True)
AutoModelForCausalLM.register(StemConfig, StemForCausalLM, exist_ok=True)

__all__ = ["StemConfig", "StemForCausalLM", "StemMLP", "StemModel", "__version__"]
