"""``python -m ds_terapipe plan|simulate|presets ...``: the same CLI as the ``ds-terapipe`` console script."""
import sys

from .cli import main

sys.exit(main())
