"""MLX's DeepSeek-V4 (mlx-vlm, what Mac users run) as a real engine: its pinned release in a venv
of its own, a checkpoint loaded as a user's would load, a harness process that scores and taps
it, and the replay of its tensors against the golden's (docs/mlx-vlm.md)."""
