"""An engine's release history, engine by engine on one frame: every release prepared (built,
converted, installed: the engine's own stages), served, scored by `fidelity kld` against the
golden and against its twin (and by `fidelity needle` at one length), adjacent releases compared
with each other against the twin's floors, and a change bisected to two neighbouring releases.
llama.cpp (fidelity.llamacpp.history) and mlx-vlm (fidelity.mlxvlm.history) are its engines."""
