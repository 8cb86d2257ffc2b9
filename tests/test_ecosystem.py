"""An exported STEM model fine-tuned by the ecosystem's trainers: Transformers' Trainer with peft LoRA
on the dense parts, the tables frozen where they lie (memory-mapped, no parameters at all)."""

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from .conftest import VOCAB, tiny_stem


def test_transformers_trainer_with_lora_on_a_stem_model(tmp_path):
    tiny_stem().save_pretrained(tmp_path / "stem")
    table_file = tmp_path / "stem" / "model.safetensors"
    before_bytes = table_file.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "stem")  # tables: mmap, the default
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    model = get_peft_model(model, lora)
    torch.manual_seed(0)
    pattern = torch.arange(16) * 5 % VOCAB  # one sequence to learn
    data = [{"input_ids": pattern, "labels": pattern} for _ in range(64)]

    def loss():
        with torch.no_grad():
            return model(input_ids=pattern[None], labels=pattern[None]).loss.item()

    start = loss()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=40, per_device_train_batch_size=8,
                             learning_rate=3e-2, report_to="none", save_strategy="no", use_cpu=True,
                             gradient_checkpointing=True, logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=data).train()
    model.eval()
    assert loss() < start - 0.5  # it learns (a random 32-wide model: slowly)
    assert table_file.read_bytes() == before_bytes  # the tables never changed
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "stem"),
                                         tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pattern[None]).logits, model(input_ids=pattern[None]).logits)
