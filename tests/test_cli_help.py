"""`stem-upcycle --help` answers without torch or transformers, and what it names is what the library accepts."""

import json
import subprocess
import sys

from stem_upcycle_cli import options

# Every help screen, in a fresh interpreter; then the heavy modules it imported (none, once the CLI reads only Click
# and its options), as JSON on the last line.
HELP_SCREENS = """
import json, sys
from stem_upcycle_cli import main
for args in [["--help"], *([name, "--help"] for name in main.commands)]:
    try:
        main(args, prog_name="stem-upcycle")
    except SystemExit as done:
        assert done.code == 0, (args, done.code)
print(json.dumps(sorted(m for m in ("torch", "transformers", "stem_upcycle") if m in sys.modules)))
"""


def test_help_imports_neither_torch_nor_transformers_nor_the_library():
    shown = subprocess.run([sys.executable, "-c", HELP_SCREENS], capture_output=True, text=True, check=True).stdout
    for name in ("convert", "train", "eval", "inspect", "edit", "compress"):
        assert f"Usage: stem-upcycle {name} [OPTIONS]" in shown  # each command's help was printed
    assert "[calib|calib-mean|closed-form]" in shown and "[memory|mmap|host]" in shown
    assert json.loads(shown.splitlines()[-1]) == []


def test_importing_the_package_still_registers_the_stem_classes():
    """What users of `import stem_upcycle` rely on: the Auto classes know the STEM config, without remote code."""
    registered = ("import stem_upcycle\n"
                  "from transformers import AutoConfig, AutoModelForCausalLM\n"
                  "config = AutoConfig.for_model('stem')\n"
                  "print(AutoModelForCausalLM._model_mapping[type(config)].__name__)")
    found = subprocess.run([sys.executable, "-c", registered], capture_output=True, text=True, check=True).stdout
    assert found.split() == ["StemForCausalLM"]


def test_the_help_names_what_the_library_accepts():
    """options.py copies the library's names and defaults (so that help needs no torch): a copy that drifts fails."""
    from stem_upcycle import convert, editing, layers, neurons, source
    from stem_upcycle.modeling import stem_tables, table_format
    from stem_upcycle.table_init import INITIALISERS, FitOptions

    assert options.FIRST_TOKEN == convert.FIRST_TOKEN
    assert options.DEFAULT_LAYER_GROUPS == convert.DEFAULT_LAYER_GROUPS
    assert options.DEFAULT_LAYERS == layers.DEFAULT_LAYERS
    assert options.ALL_COLUMNS == neurons.ALL
    assert options.DTYPES == tuple(source.DTYPES)
    assert options.INITS == tuple(sorted(INITIALISERS))
    assert options.FIT_DEFAULTS == {name: getattr(FitOptions(), name) for name in options.FIT_DEFAULTS}
    assert options.MODES == editing.MODES
    assert options.PLACEMENTS == stem_tables.PLACEMENTS
    assert options.TABLE_DTYPES == table_format.TABLE_DTYPES
    assert options.TABLE_BLOCKS == {name: block for name, (_, block) in table_format.COMPRESSED.items()}

