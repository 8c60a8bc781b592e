"""The `make_comparison` fixture (the synthetic run dirs themselves: synthetic_runs.py)."""

import pytest
from synthetic_runs import CONFIG, MAX_STEPS

from uvic.compare.plan import Arm, make_plan, write_plan


@pytest.fixture
def make_comparison(tmp_path):
    """The function `(arms={name: overrides}, seeds, out=None) -> Plan`: a checked plan written to its out dir
    (no run dirs yet; `write_run` adds them)."""

    def make(arms=None, seeds=(0, 1, 2), out=None, overrides=()):
        arms = arms or {"uvit": ["model.attention=softmax"], "uvic": []}
        plan = make_plan(CONFIG, [f"train.max_steps={MAX_STEPS}", *overrides],
                         [Arm(name, tuple(o)) for name, o in arms.items()], list(seeds), out or tmp_path / "cmp")
        write_plan(plan)
        return plan

    return make
