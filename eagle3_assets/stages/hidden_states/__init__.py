"""`hidden_states`: which merged samples get the target's hidden states (`selection.py`) and the asset that captures
them through `eagle3_resources.hidden_states`, checked (`checks.py`). May import other stages, `money`, `common`,
`eagle3_resources`."""
