"""Training of the tiny DeepSeek-V4-architecture needle model (`train_tiny.py`): synthetic
haystack data (`data.py`), a batched training forward of the same model (`forward.py`),
quantisation-aware weight grids (`qat.py`) and the recall evaluation (`evaluate.py`)."""
