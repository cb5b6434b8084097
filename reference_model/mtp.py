"""The golden's MTP (next-n predict) layers, as DeepSeek's reference `MTPBlock` computes
them (docs/research/dsv4-architecture.md §5.8): for a position i, with the main model's residual streams H[i]
(the 4 mHC copies the head would read) and the embedding of the NEXT token,

    e = enorm(embed(tok[i+1]));  h = hnorm(H[i]) per copy;  X = e_proj(e) + h_proj(h)

then an ordinary V4 Block at layer index n_layers + k (window-only attention: no
compressor, no indexer; scored MoE with `gate.bias`), and logits through the SHARED
`head.weight` with the MTP's own `hc_head_*` and `norm`. The MTP thus predicts tok[i+2].

Checkpoint names are DeepSeek's: `mtp.{k}.` + the Block's tensors + `e_proj`, `h_proj`
(FP8), `enorm`, `hnorm`, `norm` (BF16), `hc_head_fn/base/scale` (F32); `embed`/`head` are
shared with the main model. The main-model reader skips `mtp.*`; `load_mtp_weights` reads
them. The Block runs through `Model.layer` of a one-layer-longer config, so the MTP is in
the kernel seam (every toggle acts on it too) and its taps are named `mtp.{k}.*`."""
from __future__ import annotations

from dataclasses import replace as dc_replace

import torch

from .config import ModelConfig
from .model import LayerState, Model, SequenceState
from .specs import BF16, F32, FP8, TensorSpec, layer_specs
from .taps import Taps

# the MTP's own tensors beside the Block's (docs/research/dsv4-architecture.md §3.1)
_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
        "hc_head_fn", "hc_head_base", "hc_head_scale")


class MTPError(ValueError):
    """A checkpoint or config without usable MTP layers."""


def block_config(cfg: ModelConfig) -> ModelConfig:
    """The main config with one more layer, window-only and score-routed: the MTP Block is
    layer `cfg.n_layers` of it (DeepSeek's MTPBlock has layer_id n_layers, and the
    checkpoint's trailing compress_ratios entries for MTP layers are 0)."""
    if cfg.n_hash_layers > cfg.n_layers:
        raise MTPError(f"n_hash_layers {cfg.n_hash_layers} > n_layers {cfg.n_layers}: the MTP "
                       "layer would be hash-routed, which DeepSeek's MTP is not")
    return dc_replace(cfg, n_layers=cfg.n_layers + 1, compress_ratios=tuple(cfg.compress_ratios) + (0,))


def mtp_specs(cfg: ModelConfig, k: int = 0) -> list[TensorSpec]:
    """Every tensor of MTP layer k, with its `mtp.{k}.` name (shapes as the main layers')."""
    n, d, hc = cfg.n_layers, cfg.dim, cfg.hc_mult
    p = f"mtp.{k}."
    blk = [TensorSpec(p + s.name[len(f"layers.{n}."):], s.shape, s.fmt)
           for s in layer_specs(block_config(cfg), n)]
    own = [TensorSpec(p + "e_proj.weight", (d, d), FP8), TensorSpec(p + "h_proj.weight", (d, d), FP8),
           TensorSpec(p + "enorm.weight", (d,), BF16), TensorSpec(p + "hnorm.weight", (d,), BF16),
           TensorSpec(p + "norm.weight", (d,), BF16),
           TensorSpec(p + "hc_head_fn", (hc, hc * d), F32), TensorSpec(p + "hc_head_base", (hc,), F32),
           TensorSpec(p + "hc_head_scale", (1,), F32)]
    return blk + own


def random_mtp_weights(cfg: ModelConfig, k: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random MTP tensors on their checkpoint grids (names without `mtp.{k}.`)."""
    from .weights import _init_value, to_grid
    g = torch.Generator().manual_seed(seed)
    p = f"mtp.{k}."
    return {s.name[len(p):]: to_grid(s, _init_value(s, g, cfg)) for s in mtp_specs(cfg, k)}


def load_mtp_weights(path, k: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """MTP layer k of a DeepSeek-native checkpoint, dequantised as the main layers are
    (names without `mtp.{k}.`). MTPError names what is missing or malformed."""
    from .checkpoint_format import disk_entries
    from .checkpoint_read import _load_specs, scan_checkpoint
    info = scan_checkpoint(path)
    cfg = info.cfg
    if cfg.n_mtp_layers <= k:
        raise MTPError(f"checkpoint {info.root} has num_nextn_predict_layers={cfg.n_mtp_layers}: "
                       f"no MTP layer {k}")
    specs = mtp_specs(cfg, k)
    problems = []
    for s in specs:
        for e in disk_entries(s, info.layout, info.float_dtype):
            h = info.skipped.get(e.name)
            if h is None:
                problems.append(f"missing tensor: {e.name}")
            elif h.dtype != e.dtype or tuple(h.shape) != tuple(e.shape):
                problems.append(f"{e.name}: expected {e.dtype} {list(e.shape)}, found {h.dtype} "
                                f"{list(h.shape)}")
    if problems:
        raise MTPError(f"checkpoint {info.root}: MTP layer {k}: " + "; ".join(problems))
    view = dc_replace(info, tensors=dict(info.skipped))
    return _load_specs(view, specs, torch.device(device), 64 << 20, strip=f"mtp.{k}.")


class _BlockWeights:
    """The main model's globals plus the MTP Block as layer n_layers (a WeightSource)."""

    resident = True

    def __init__(self, cfg: ModelConfig, main, block: dict):
        self.cfg, self._main, self._block = cfg, main, block

    def global_weights(self):
        return self._main.global_weights()

    def layer_weights(self, i):
        if i != self.cfg.n_layers - 1:
            raise IndexError(f"the MTP block is layer {self.cfg.n_layers - 1}, not {i}")
        return self._block


class _Renamed:
    """Taps seen through a prefix rename: the Block's `layers.{n}.` become `mtp.{k}.`."""

    def __init__(self, taps: Taps, old: str, new: str):
        self.taps, self.old, self.new = taps, old, new

    def __bool__(self):
        return True

    def put(self, name, value):
        self.taps.put(self.new + name[len(self.old):] if name.startswith(self.old) else name, value)


class MTP:
    """MTP layer k beside a main Model, in that model's seam (its Numerics and weight cache).
    `forward(H, next_tokens, state)` runs positions state.pos.. and returns (logits of the
    last position or of all, the MTP's own output streams: what a second draft step feeds
    back as H)."""

    def __init__(self, model: Model, weights: dict[str, torch.Tensor], k: int = 0):
        cfg = model.cfg
        if getattr(cfg, "is_v41", False) or not isinstance(cfg, ModelConfig):
            raise MTPError("MTP layers are modelled for DeepSeek-V4 only")
        missing = [n for n in _OWN if n not in weights]
        if missing:
            raise MTPError(f"MTP layer {k}: missing {', '.join(missing)}")
        self.model, self.k, self.cfg = model, k, cfg
        self.own = {n: weights[n] for n in _OWN}
        bcfg = block_config(cfg)
        self.index = cfg.n_layers
        block = {n: v for n, v in weights.items() if n not in _OWN}
        self.runner = Model(_BlockWeights(bcfg, model.weights, block), model.nx,
                            chunk_tokens=model.chunk_tokens, attn_budget=model.attn_budget)

    @property
    def nx(self):
        return self.model.nx

    def sync(self) -> None:
        """Follow the main model's Numerics (an arm swapped in after construction)."""
        self.runner.nx = self.model.nx

    def new_state(self, pos: int = 0) -> SequenceState:
        """An empty MTP state whose first position is `pos` (window-only attention: a state
        started at pos >= n - window gives the same last-position output as one from 0)."""
        return SequenceState([None] * self.index + [LayerState()], pos)

    def _own(self, name, own=None):
        v = (self.own if own is None else own)[name]
        return v.to(self.nx.cd) if v.is_floating_point() else v

    def prelude(self, H, tokens, own=None):
        """X = e_proj(enorm(embed(tokens))) + h_proj(hnorm(H)) per copy: the Block's input
        [n, hc, dim]. `own`: the MTP's own tensors (default its weights; training passes
        its trainable ones)."""
        nx, cfg = self.nx, self.cfg
        n = tokens.numel()
        emb = self.model.weights.global_weights()["embed.weight"]
        e = nx.rms_norm(nx.rs(emb[tokens.to(emb.device)]), self._own("enorm.weight", own), cfg.norm_eps)
        h = nx.rms_norm(nx.c(H).reshape(n * cfg.hc_mult, cfg.dim), self._own("hnorm.weight", own),
                        cfg.norm_eps)
        ep = nx.fp8_linear(e, self._own("e_proj.weight", own))
        hp = nx.fp8_linear(h, self._own("h_proj.weight", own)).view(n, cfg.hc_mult, cfg.dim)
        return nx.rs(ep.unsqueeze(1) + hp)                    # a bf16 add in the reference

    def forward(self, H: torch.Tensor, next_tokens, state: SequenceState, logits: str = "last",
                taps: Taps | None = None, phase: str | None = None):
        """H [n, hc, dim] main streams at positions state.pos.., next_tokens [n] the tokens
        at the positions after them. Returns (logits, streams [n, hc, dim])."""
        self.sync()
        nx, cfg = self.nx, self.cfg
        tokens = self.model.check_tokens(next_tokens, state)
        n = tokens.numel()
        if H.dim() != 3 or H.shape[0] != n or H.shape[1:] != (cfg.hc_mult, cfg.dim):
            raise MTPError(f"MTP input streams must be [{n}, {cfg.hc_mult}, {cfg.dim}], got "
                           f"{tuple(H.shape)}")
        if phase is None:
            phase = "decode" if state.pos > 0 and n == 1 else "prefill"
        X = self.prelude(H, tokens)
        t = _Renamed(taps, f"layers.{self.index}.", f"mtp.{self.k}.") if taps else None
        if t:
            t.put(f"mtp.{self.k}.in", X)
        out = self.runner.layer(self.index, X.to(nx.sd), tokens, state, t, phase)
        state.pos += n
        rows = out if logits == "all" else out[-1:]
        return self.head(rows, t), out

    def head(self, H, taps=None, own=None) -> torch.Tensor:
        """The shared head with the MTP's own hc_head params and final norm."""
        nx, cfg = self.nx, self.cfg
        x = nx.hc_head(H, self._own("hc_head_fn", own), self._own("hc_head_scale", own),
                       self._own("hc_head_base", own), cfg)
        x = nx.rms_norm(x, self._own("norm.weight", own), cfg.norm_eps)
        if taps:
            taps.put(f"mtp.{self.k}.final_hidden", x)
        head = self.model._weights(None, head=True)["head.weight"]
        lg = nx.lm_head(x, head)
        if taps:
            taps.put(f"mtp.{self.k}.logits", lg)
        return lg


def mtp_for(model: Model, source, k: int = 0) -> MTP:
    """MTP layer k for `model` from a checkpoint path or a dict of MTP tensors."""
    w = source if isinstance(source, dict) else load_mtp_weights(source, k)
    return MTP(model, w, k)
