"""The names and defaults that `stem-upcycle --help` shows, without importing torch or transformers.

Each is a copy of the definition the library enforces (the modeling package imports nothing of stem-upcycle,
being copied next to the weights; the others keep theirs beside the code that reads them):
tests/test_cli_help.py fails when a copy and its original differ.
"""

FIRST_TOKEN = ("dense", "table")  # convert.FIRST_TOKEN
DEFAULT_LAYER_GROUPS = 5  # convert.DEFAULT_LAYER_GROUPS
DEFAULT_LAYERS = "all"  # layers.DEFAULT_LAYERS
ALL_COLUMNS = "all"  # neurons.ALL: every neuron of a converted layer is a table column
DEFAULT_SHARE = "1/6"  # neurons.DEFAULT_SHARE: --columns not given, with --layers all
DEFAULT_GENERATED = 65536  # table_init.calibrated.DEFAULT_GENERATED: --calib-generate not given, without --calib-data
DTYPES = ("bfloat16", "float32", "float16")  # source.DTYPES
INITS = ("calib", "calib-mean", "closed-form")  # table_init.INITIALISERS, sorted
FIT_DEFAULTS = {"sequential": False, "refit_down": 0.0, "epochs": 0}  # table_init.FitOptions
PARENT_DEFAULTS = {"contexts": 16, "reads": 4, "shrink": 8.0}  # table_init.ParentRowOptions.contexts, .reads,
# InitOptions.shrink
FACT_WEIGHT = 0.25  # table_init.InitOptions.fact_weight
MODES = {  # editing.MODES
    "auto": "one_to_one when source and target have as many tokens, else average",
    "one_to_one": "source token i reads target token i (equal lengths only)",
    "average": "every source token reads the mean of the target's rows",
    "copy": "source token i reads target token i mod the target's length (the target's rows cycled)",
    "left_pad": "the target right-aligned: padding tokens first, a longer target keeps its last tokens",
    "right_pad": "the target left-aligned: padding tokens last, a longer target keeps its first tokens",
}
PLACEMENTS = ("memory", "mmap", "host")  # modeling.stem_tables.PLACEMENTS
TABLE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8", "int4")  # modeling.table_format.TABLE_DTYPES
TABLE_BLOCKS = {"int8": 128, "float8": 128, "int4": 64}  # modeling.table_format.COMPRESSED: elements per scale
