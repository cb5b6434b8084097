"""llama.cpp as a real DeepSeek-V4 engine: where its build lives, GGUF conversion of our
checkpoints with llama.cpp's own converter, its logits file format, and its tensor dumps."""
