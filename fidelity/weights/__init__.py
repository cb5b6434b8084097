"""Weights as the commands see them, from the config and the checkpoint files:

  source   which weights a command runs on (a checkpoint streamed / resident-quantised /
           dense, or the embedded default) and its tokenizer
  target   weights + tokenizer for generation (`fidelity serve`, the needle runners, kld)
  plan     memory plan of a lockstep run per device, from the config alone (`plan-memory`);
           its parts: plan_inputs, plan_layers, plan_devices, plan_advice, plan_render
  diff     two checkpoints compared tensor by tensor on dequantised values (`weights-diff`);
           diff_report writes its report folder and terminal summary
  sizes    byte sizes as people write them (96GB, 141GiB)

Everything here raises typed errors (ValueError subclasses) on bad input; the commands
turn them into fidelity.errors.CommandError."""
