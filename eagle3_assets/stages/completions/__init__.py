"""`completions`: the target's answers to each prompt, bought under the spend caps (`run.py`), piloted on a small
sample first (`pilot.py`), checked (`checks.py`). May import other stages, `money`, `common`, `eagle3_resources`."""
