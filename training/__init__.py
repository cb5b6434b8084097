"""Training of the tiny DeepSeek-V4-architecture needle model (`train_tiny.py`, with its
run in `run_state.py`, one step in `train_step.py`, the per-step `schedule.py` and the
start and shipped weights in `weights_init.py`): synthetic haystack data (`data.py`), a
batched training forward of the same model (`forward.py`), quantisation-aware weight
grids (`qat.py`) and the recall evaluation (`evaluate.py`)."""
