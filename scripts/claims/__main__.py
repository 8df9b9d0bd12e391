"""`python scripts/claims [--quick] [--only NAMES] [--write FILE]`: see run.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `claims` importable as a package

from claims.run import main  # noqa: E402

sys.exit(main())
