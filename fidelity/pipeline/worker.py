"""A rank > 0 of a per-prompt pipeline (fidelity.pipeline.model): `work` runs rank 0's
calls (build a model, extend a state over this rank's layers, a state operation) until rank
0 says stop; a failure travels down the pipeline to rank 0 in place of the streams."""
from __future__ import annotations

from dataclasses import dataclass, field

from reference_model.schedule import co_batched

from .stage import carried, carry_in, stage_state
from .calls import Recipe, calls_group, rank_state_op, stage_devices


@dataclass
class Worker:
    """A worker's models (by rank 0's model key) and its layers' part of each state (by
    rank 0's handle id)."""
    stage: object
    weights: object
    models: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)       # model key -> its recorder's sink
    states: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)
    broken: dict = field(default_factory=dict)       # model key -> why it could not be built

    def build(self, key, recipe: Recipe) -> None:
        self.scores[key] = sink = []
        try:
            self.models[key] = recipe.build(self.weights, stage_devices(self.stage), self.cache, sink.append)
        except Exception as e:                        # said on rank 0 at the model's first call
            self.broken[key] = f"{type(e).__name__}: {e}"

    def extend(self, cmd) -> None:
        st = self.stage
        meta, got = st.recv_streams("the call's streams")
        out, taps_out, scores = [], [], []
        if meta.get("failed") or meta["error"]:
            pass
        else:
            try:
                out, taps_out, scores = self._run(cmd, got[0], meta)
                if st.last and cmd["rows"] != "all":
                    out = [] if cmd["rows"] == "none" else [out[0][-1:]]
            except Exception as e:                    # goes down the pipeline to rank 0
                meta = {"error": f"{st.describe()} failed: {type(e).__name__}: {e}"}
        meta = {**meta, "taps": meta.get("taps", []) + taps_out, "scores": meta.get("scores", []) + scores}
        st.send_streams(meta, out, "the call's streams", peer=(st.rank + 1) % st.world)

    def _run(self, cmd, H, meta):
        """This rank's layers of one call; `meta["carried"]` comes in and goes on updated."""
        key = cmd["key"]
        if key in self.broken:
            raise RuntimeError(f"its model could not be built: {self.broken[key]}")
        from reference_model import Taps
        model, sink = self.models[key], self.scores[key]
        state = self.states.get(cmd["state"])
        if state is None:
            state = self.states[cmd["state"]] = stage_state(model, self.stage)
        taps = Taps(cmd["taps"], latest=cmd["latest"]) if cmd["taps"] else None
        tokens = cmd["tokens"].to(H.device)
        del sink[:]
        carry_in(state, meta["carried"])
        with co_batched(cmd["mates"]):
            for i in self.stage.layers:
                H = model.layer(i, H, tokens, state, taps, cmd["phase"])
        state.pos += tokens.numel()
        meta["carried"] = carried(state)
        parts = [(n, p) for n in (taps.names() if taps else []) for p in taps.parts(n)]
        return [H], parts, list(sink)

    def state_op(self, cmd) -> None:
        """Rank 0's state_op on this rank's part; the reply (bytes, or an error) is gathered."""
        try:
            model = self.models[cmd["key"]]
            state = self.states.get(cmd["state"])
            if state is None:                  # created on rank 0, never extended yet
                state = self.states[cmd["state"]] = stage_state(model, self.stage)
            out = rank_state_op(model, self.stage.layers, cmd["what"], state)
            if cmd["new"] is not None:
                self.states[cmd["new"]] = out
            if cmd["what"] != "bytes":
                out = None
        except Exception as e:
            out = f"{self.stage.describe()} failed ({cmd['what']} of a state): {type(e).__name__}: {e}"
        self.stage.gather(out, f"the {cmd['what']} of a state")


def work(stage, weights) -> None:
    """A rank > 0: run rank 0's calls on this stage's layers until it says stop."""
    w, group = Worker(stage, weights), calls_group()
    while True:
        cmd = stage.from_first(None, "rank 0's next call", group)
        for sid in cmd["free"]:
            w.states.pop(sid, None)
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "model":
            w.build(cmd["key"], cmd["recipe"])
        elif cmd["op"] == "extend":
            w.extend(cmd)
        elif cmd["op"] == "state":
            w.state_op(cmd)
