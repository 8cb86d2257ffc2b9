"""The table initialisers `--init` can name."""

from .calibrate import CalibratedInit, CalibratedMeanInit
from .init import ClosedFormInit

INITIALISERS = {cls.name: cls for cls in (ClosedFormInit, CalibratedInit, CalibratedMeanInit)}
