"""`raw_prompts`: the registered datasets' prompts, sampled, validated and rendered (`prompts.py`), imported from the
real public sets (`importers/`), checked (`checks.py`). May import `money`, `common`, `eagle3_resources`."""
