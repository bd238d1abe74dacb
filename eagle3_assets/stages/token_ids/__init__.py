"""`token_ids`: each conversation re-tokenized into the training ids and loss mask (`reconstruct.py`), checked against
what the backend billed (`checks.py`). May import other stages, `money`, `common`, `eagle3_resources`."""
