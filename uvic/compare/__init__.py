"""Paired comparisons of training configs over seeds: `compare.py` is the command line over this package.

    plan.py          arms x seeds -> the runs and their `train.py` commands, checked before anything trains; plan.json
    run.py           trains the runs of a plan here, `--jobs` at a time, resumably
    rundirs.py       what the report reads from a run dir: its state, its logs
    metrics.py       the registries of the numbers (`METRICS`) and curves (`CURVES`) a report compares
    protocol_fid.py  `--gen-seeds K`: each finished run's final FID K times, disjoint sampling seeds, resumably
    stats.py         paired differences, their Student-t interval, the paired t-test, the verdict; the FID's spreads
    figures.py       the report's PNG figures
    report.py        report.json, report.md, report.html (self-contained)
"""
