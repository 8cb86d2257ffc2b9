"""Tiny random dense models of every supported family, saved the way Hugging Face saves them."""

import json
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)

# Per family, what differs from COMMON; chosen to exercise each family's numerics.
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "gemma": {"head_dim": 8, "hidden_act": "gelu_pytorch_tanh"},
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4},
    "olmo2": {},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "logits_scaling": 2.0, "mlp_bias": True},
    "phi3": {"pad_token_id": 0, "tie_word_embeddings": False},
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Tokenised text and generated text go to a cache of this test session, never the user's; the parent's text and
    rows are read in fp32 on every machine (loading.fast_dtype would take bf16 where a CPU has it natively)."""
    monkeypatch.setenv("STEM_UPCYCLE_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("STEM_UPCYCLE_FAST_DTYPE", "float32")


def tiny_dense(model_type: str = "llama", seed: int = 0, **overrides):
    """A random dense causal LM of the family, in fp32, with norm weights perturbed off 1."""
    fields = {**COMMON, **FAMILY_CONFIGS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases, so that the init has to get them right
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def tiny_stem(model_type="llama", layers=(0, 2), seed=0, dense_first_token=True, columns=None, **overrides):
    """A random STEM model of the family (its tiny_dense parent's config, tables random), in eval mode; `columns`:
    {layer: k}, the layers whose tables hold k of their neurons (the others keep up_rest)."""
    from stem_upcycle import StemForCausalLM
    from stem_upcycle.convert import stem_config
    from stem_upcycle.families import family_for

    dense = tiny_dense(model_type, seed=seed, **overrides)
    config = stem_config(dense.config, family_for(model_type), list(layers), "random", torch.float32, False,
                         dense_first_token)
    config.stem_table_columns = {str(layer): k for layer, k in (columns or {}).items()} or None
    torch.manual_seed(seed)
    return StemForCausalLM(config).eval()


def save_tiny_tokenizer(path):
    """A word-level tokenizer: "w0".."w93" are ids 0-93, <eos> 94, <unk> 95; with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<eos>": VOCAB - 2, "<unk>": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture
def dense_dir(tmp_path):
    """Factory: save a tiny dense model of a family to a directory, return (model, path)."""

    def make(model_type="llama", name="dense", **overrides):
        model = tiny_dense(model_type, **overrides)
        path = tmp_path / name
        model.save_pretrained(path)
        return model, path

    return make


@pytest.fixture
def host_on_cpu(monkeypatch):
    """The `host` placement's code, run with the CPU as its device (streams are then no-ops)."""
    from stem_upcycle.modeling import stem_tables

    monkeypatch.setattr(stem_tables, "accelerator_available", lambda: True)


@pytest.fixture
def ids():
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (2, 11))


def export_stem(model, path):
    """Save a STEM model as `convert` exports it: weights, a config with auto_map, the modeling files."""
    from stem_upcycle.convert import AUTO_MAP, MODELING_DIR, MODELING_FILES

    model.config.auto_map = dict(AUTO_MAP)
    model.save_pretrained(path)
    for name in MODELING_FILES:
        shutil.copyfile(MODELING_DIR / name, path / name)
    return path


def run_without_stem_upcycle(script: str, *args, timeout: int = 600) -> str:
    """Run `script` (with `args` as sys.argv[1:]) in a fresh Python in which `stem_upcycle` cannot be
    imported, as for a user who loads an exported model with `trust_remote_code=True` alone; its stdout.
    The test fails on a non-zero exit, with the end of the script's stderr."""
    guard = textwrap.dedent("""
        import sys
        sys.modules["stem_upcycle"] = None  # as if stem-upcycle were not installed
        try:
            import stem_upcycle
        except ImportError:
            pass
        else:
            raise SystemExit("stem_upcycle is importable")
    """)
    result = subprocess.run([sys.executable, "-c", guard + textwrap.dedent(script), *map(str, args)],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def markov_text(n: int, seed: int) -> str:
    """Words w0..w59 where each word mostly determines the next: learnable by a tiny model."""
    g = torch.Generator().manual_seed(seed)
    word, words = 0, []
    for _ in range(n):
        words.append(f"w{word}")
        word = (word * 7 + 3) % 60 if torch.rand(1, generator=g) < 0.8 else int(torch.randint(0, 60, (1,), generator=g))
    return " ".join(words)


@pytest.fixture
def workspace(tmp_path):
    """A tiny dense llama with a tokenizer, its STEM conversion, and training / held-out text."""
    from stem_upcycle.convert import plan_conversion, run_conversion
    from stem_upcycle.source import open_source
    from stem_upcycle.table_init import InitOptions

    tiny_dense("llama").save_pretrained(tmp_path / "dense")
    save_tiny_tokenizer(tmp_path / "dense")
    (tmp_path / "train.txt").write_text(markov_text(6000, 0))
    (tmp_path / "heldout.txt").write_text(markov_text(800, 1))
    plan = plan_conversion(open_source(str(tmp_path / "dense")), layers="0,2", init="calib",
                           init_options=InitOptions(calib_data=[str(tmp_path / "train.txt")], calib_seq_len=32))
    run_conversion(plan, tmp_path / "stem", progress=False)
    return tmp_path


def train_overrides(ws, *extra):
    """`--set` values that train the workspace's STEM model on its text for a few steps, then EXTRA."""
    return [f"model.source={ws / 'dense'}", f"model.init_from={ws / 'stem'}", f"data.train=[{ws / 'train.txt'}]",
            f"data.eval=[{ws / 'heldout.txt'}]", "data.seq_len=32", "data.eval_tokens=256", "train.batch_size=8",
            "train.micro_batch_size=4", "train.eval_every=0", "train.warmup_steps=2", "tables.lr=0.05", *extra]


@contextmanager
def crashing_at(monkeypatch, step: int):
    """Inside the block, a Trainer stops at optimizer step `step` (0-based) as a killed run does (the block expects
    that KeyboardInterrupt); after it, steps run again."""
    from stem_upcycle.training.trainer import Trainer

    real_step = Trainer.train_step

    def crash(self, at):
        if at == step:
            raise KeyboardInterrupt
        return real_step(self, at)

    monkeypatch.setattr(Trainer, "train_step", crash)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(Trainer, "train_step", real_step)


def train_log(path):
    """A training run's log: one dict per line of OUTPUT/train_log.jsonl."""
    return [json.loads(line) for line in (path / "train_log.jsonl").read_text().splitlines()]
