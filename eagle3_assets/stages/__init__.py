"""The pipeline's stages, one folder per asset and named as the asset: its `asset.py`, its logic, its `checks.py`.

A stage may import another stage (completions reconstructs token ids as it goes), `money`, `common` and
`eagle3_resources`; never `operations` or `definitions` (tests/test_import_direction.py). `pipeline.py` lists the
six assets in lineage order for the job and the code location.
"""
