"""Plumbing shared by the stages, money and operations: the dataset registry and its partitions (`registry.py`),
per-dataset checks and their outcome (`per_dataset.py`, `outcome.py`), metadata values (`metadata.py`), stop
signals (`stop_signals.py`), the per-stage Kubernetes pod tags (`k8s.py`).

May import `eagle3_resources` only: nothing of `money`, `stages` or `operations` (tests/test_import_direction.py).
"""
