"""Running the pipeline: the `eagle3` command (`cli.py`), `eagle3 status` (`status.py`) and the `pipeline_status`
asset (`quality.py`), the instance (`instance.py`), the GPU host check (`gpu_check.py`), the job, sensors and
schedule (`jobs.py`, `sensors.py`, `schedules.py`), recording SGLang's benchmark figures (`record_figures.py`).

The top layer, with `definitions.py`: may import `stages`, `money`, `common` and `eagle3_resources`; nothing imports
it but `definitions.py` and other operations modules (tests/test_import_direction.py).
"""
