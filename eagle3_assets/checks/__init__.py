"""Asset checks: plain functions over a stage's output, each returning a `CheckOutcome`."""
