"""How close a plan's token estimate for a Hub dataset (hub_datasets.py: the listing's sizes times the tokens per
byte of a sample of the first file) comes to the tokens each file holds, on real text.

    python benchmarks/dataset_estimate.py [--tokenizer smollm2-135m] [--files 6] [--row-group 100]

The project's texts (data/: run scripts/get-shakespeare.sh, get-broad-texts.sh, get-ood-texts.sh first) are cut
into documents of ~3 KB, shuffled, and written as FineWeb-like parquet shards (text, id, url, score; snappy) under
sample/10BT/ of a dataset served by tests/hub_server.py on the loopback. The plan's resolution runs as `train --plan`
runs it (one range-read sample of the first shard's first row group); then every shard is downloaded and
tokenised, and each one's estimate (its size x the sample's tokens per byte) is printed against its tokens. The
files a run takes are chosen by these estimates with a margin of 1.25 (hub_datasets.MARGIN).
"""

import argparse
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from inference import machine  # noqa: E402


def shards(folder: Path, files: int, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = []
    for path in sorted((REPO / "data").rglob("*.txt")):
        document = ""
        for paragraph in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            document += paragraph.strip() + "\n\n"
            if len(document) > 3000:
                documents.append((path.stem, document))
                document = ""
    if not documents:
        raise SystemExit("no text under data/: run scripts/get-shakespeare.sh, get-broad-texts.sh, get-ood-texts.sh")
    random.Random(0).shuffle(documents)
    folder.mkdir(parents=True)
    for i in range(files):
        part = documents[i::files]
        table = pa.table({"text": [d for _, d in part], "id": [f"<urn:uuid:{i}-{k}>" for k in range(len(part))],
                          "url": [f"https://example.org/{genre}/{k}" for k, (genre, _) in enumerate(part)],
                          "score": [3.0] * len(part)})
        pq.write_table(table, folder / f"{i:03d}_00000.parquet", row_group_size=row_group, compression="snappy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="smollm2-135m", help="a SOURCE whose tokenizer counts the tokens")
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--row-group", type=int, default=100, help="documents per parquet row group")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dataset-estimate-"))
    os.environ["STEM_UPCYCLE_CACHE"] = str(root / "cache")
    import huggingface_hub.constants as constants
    import pyarrow.parquet as pq

    from stem_upcycle.hub_datasets import DatasetSpec, download, resolve
    from stem_upcycle.loading import load_tokenizer
    from stem_upcycle.source import open_source
    from stem_upcycle.training.tokens import tokenize_corpus
    from tests.hub_server import LocalHub

    shards(root / "repo" / "sample" / "10BT", args.files, args.row_group)
    hub = LocalHub({"datasets/bench/web": {"main": root / "repo"}})
    constants.ENDPOINT = hub.url
    constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    constants.HF_HUB_CACHE = str(root / "hf-cache")
    tokenizer = load_tokenizer(open_source(args.tokenizer))
    print(f"{machine()}; the tokenizer of {args.tokenizer}")
    start = time.perf_counter()
    resolved = resolve(DatasetSpec.parse("hf:bench/web/sample/10BT/*.parquet", "bench"), 10**15, tokenizer, "text")
    print(f"plan: listing and a sample of the first shard in {time.perf_counter() - start:.2f} s: "
          f"{resolved.tokens_per_byte:.4f} tokens per byte")
    worst = 0.0
    for path in download(resolved, None, progress=False):
        tokens = len(tokenize_corpus([path], tokenizer, "text", root / "tokens"))
        estimate = path.stat().st_size * resolved.tokens_per_byte
        worst = max(worst, abs(estimate / tokens - 1))
        print(f"  {path.name}: {path.stat().st_size / 1e6:.2f} MB, {pq.ParquetFile(path).num_row_groups} row groups, "
              f"{tokens:,} tokens, estimated {estimate:,.0f} ({estimate / tokens:.3f}x)")
    print(f"worst estimate off by {worst:.1%}; the margin is 25%")
    hub.close()


if __name__ == "__main__":
    main()
