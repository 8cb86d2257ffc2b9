"""Table initialisation: how the rows of a new STEM table are computed (`convert --init`), and which
layers to convert (`--layers auto:`, layer_choice.py).

- protocol.py: what an initialiser is given (`InitTarget`, `InitOptions`) and answers (`TableInit`);
- closed_form.py: `closed-form`, rows from the dense weights alone;
- calibrated.py: `calib` and `calib-mean`, rows averaged from the dense model's own up-projections on text;
- layer_fit.py: those rows, and the gate and down projections, fitted to the parent layer after layer (`FitOptions`);
- layer_choice.py: each layer converted alone and scored, the cheapest kept.
"""

from .calibrated import CalibratedInit, CalibratedMeanInit
from .closed_form import ClosedFormInit
from .protocol import FitOptions, InitOptions, InitTarget, RowsFn, TableInit

INITIALISERS: dict[str, type[TableInit]] = {cls.name: cls for cls in (ClosedFormInit, CalibratedInit, CalibratedMeanInit)}

__all__ = ["INITIALISERS", "CalibratedInit", "CalibratedMeanInit", "ClosedFormInit", "FitOptions", "InitOptions", "InitTarget",
           "RowsFn", "TableInit"]
