"""An entry script for tests/test_early_ranks.py: as an early rank, wait for orders, then record what it got."""

import json
import os
import sys

sys.path.insert(0, os.environ["EARLY_TEST_ROOT"])

from src.engine.runtime import early_ranks  # noqa: E402

early_ranks.PREIMPORTS = ("json",)  # the test is about the orders, not about importing Lightning
early_ranks.start_ranks_early(__file__, "configs", "unused")
with open(os.environ["EARLY_TEST_RECORD"], "w") as record:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}, record)
