"""Which files of a Hugging Face checkpoint folder stem-upcycle reads: what a local folder is opened from
(source.py) and what is downloaded of a repository (hub.py)."""

# Tokenizer files, copied to a converted model as they are.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)
# Besides weights and tokenizer files: what stem-upcycle reads (the card: the base model's licence).
SMALL_FILES = ("config.json", "generation_config.json", "README.md")
# The weight formats read, in order of preference: (single file, suffix of shards); each may have SINGLE.index.json.
WEIGHT_FORMATS = (("model.safetensors", ".safetensors"), ("pytorch_model.bin", ".bin"))
NOT_WEIGHTS = ("training_args.bin",)  # a .bin in many checkpoints that holds no weights


def weight_file_names(names: set[str], read_index) -> list[str]:
    """The weight files of a checkpoint whose top-level file names are `names`, in the first format it has:
    the shards its index names, else the single file, else every file of the suffix. `read_index(name)` reads
    an index file (a dict with a weight_map)."""
    for single, suffix in WEIGHT_FORMATS:
        index = f"{single}.index.json"
        if index in names:
            return list(dict.fromkeys(read_index(index)["weight_map"].values()))
        if single in names:
            return [single]
        if found := sorted(n for n in names if n.endswith(suffix) and n not in NOT_WEIGHTS):
            return found
    return []
