"""`merged_dataset`: every dataset's token ids in one training set (`merge.py`), checked (`checks.py`). May import
other stages, `money`, `common`, `eagle3_resources`."""
