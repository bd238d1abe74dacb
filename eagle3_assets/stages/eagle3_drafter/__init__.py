"""`eagle3_drafter`: model, draft vocabulary, training-time-test training, SGLang export, its asset and checks.

May import other stages, `money`, `common` and `eagle3_resources`; `train_cli.py` is what torchrun starts on a GPU
host (`-m eagle3_assets.stages.eagle3_drafter.train_cli`).
"""
