"""Shared settings for the property and fuzz tests.

Every test here is bounded for CI: a fixed number of examples, derandomized (the same examples on
every run, no example database), no deadline. For a longer, randomised hunt:

    EGRESS_FUZZ_SCALE=20 python -m pytest tests/fuzz      # 20x the examples, a fresh random seed
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("EGRESS_FUZZ_SCALE", "1"))


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max(1, int(max_examples * SCALE)),
        deadline=None,
        derandomize=SCALE == 1,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
        print_blob=True,
    )
