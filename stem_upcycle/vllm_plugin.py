"""vLLM's plugin entry point (`vllm.general_plugins` in pyproject.toml), which vLLM calls in each of its processes:
it names the class vLLM builds for a STEM model's config (`vllm_model.py`), imported only when a STEM model is
built, as vLLM asks of plugins."""

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .families import SUPPORTED

# What a STEM model's config.json may name: `convert` writes StemForCausalLM; a model saved by save_pretrained
# names its family's class (StemLlamaForCausalLM, ...).
ARCHITECTURES = ("StemForCausalLM", *("Stem" + MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in SUPPORTED))


def register() -> None:
    from vllm import ModelRegistry

    for architecture in ARCHITECTURES:
        if architecture not in ModelRegistry.get_supported_archs():  # vLLM may load plugins more than once
            ModelRegistry.register_model(architecture, "stem_upcycle.vllm_model:StemForCausalLM")
