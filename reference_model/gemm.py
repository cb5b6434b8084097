"""How a layer's FP8 Linear and its experts run, the version part that differs in the
weight grid and activation-quant block (chosen by the config: reference_model.version).

V4 (`Gemm128`): `fp8_linear` (1x128 activation quant), weights held dequantised as given.
V4.1 (`Gemm32`): every FP8 weight passes `weight_dequant` (32x32 blocks: a loader reading
another grid is a toggle) and `fp8_linear32` / `expert_ffn32` quantise activations 1x32."""
from __future__ import annotations

from .part import ModelPart


class Gemm128(ModelPart):
    """DeepSeek-V4's GEMMs."""

    def lin(self, x, w: dict, name: str):
        """The layer's FP8 Linear `name` (weights key `name + '.weight'`) on x."""
        return self.nx.fp8_linear(x, w[name + ".weight"])

    def dq(self, t):
        """An FP8 weight as the GEMM sees it (V4: held dequantised, as is)."""
        return t

    def expert(self, x, w: dict, prefix: str, weight, limit: float, shared: bool):
        """A SwiGLU expert (routed: `weight` [n]; shared: None) of the MoE."""
        return self.nx.expert_ffn(x, w[prefix + "w1.weight"], w[prefix + "w3.weight"],
                                    w[prefix + "w2.weight"], weight, limit)


class Gemm32(Gemm128):
    """DeepSeek-V4.1's GEMMs: 32x32 FP8 weight blocks, 1x32 activation quant."""

    def lin(self, x, w: dict, name: str):
        nx = self.nx
        return nx.fp8_linear32(x, nx.weight_dequant(w[name + ".weight"]))

    def dq(self, t):
        return self.nx.weight_dequant(t)

    def expert(self, x, w: dict, prefix: str, weight, limit: float, shared: bool):
        """Routed experts are FP4 (no weight_dequant); the shared expert is FP8 32x32."""
        dq = self.dq if shared else (lambda t: t)
        return self.nx.expert_ffn32(x, dq(w[prefix + "w1.weight"]), dq(w[prefix + "w3.weight"]),
                                      dq(w[prefix + "w2.weight"]), weight, limit)
