"""Which served model an endpoint arm queries. One server may serve several arms (e.g.
`fidelity serve --arm golden=... --arm engine=...`), so taking the first listed model
would score every arm on one of them: an arm takes the model named like it, a model
chosen for it, or the only one served -- and otherwise fails, naming what is served.
Shared by `fidelity needle` and `fidelity kld`."""
from __future__ import annotations


class ModelChoiceError(ValueError):
    """No served model can be told to be this arm's."""


def pick_model(arm: str, wanted: str | None, served: list[str]) -> str:
    """The model arm `arm` queries: `wanted` if given (it must be served), else the served
    model named `arm`, else the only one served."""
    listed = ", ".join(served) or "none"
    if wanted is not None:
        if served and wanted not in served:
            raise ModelChoiceError(f"endpoint {arm!r}: model {wanted!r} is not served (served: {listed})")
        return wanted
    if arm in served:
        return arm
    if len(served) == 1:
        return served[0]
    raise ModelChoiceError(
        f"endpoint {arm!r}: the server serves {len(served)} models ({listed}) and none is named "
        f"{arm!r}; name the arm after one (--endpoint MODEL=URL) or choose one with "
        f"--model {arm}=MODEL")


def model_options(values: list[str], arms: list[str]) -> tuple[str | None, dict[str, str]]:
    """--model values: 'ARM=MODEL' for one endpoint arm, a bare 'MODEL' for every arm not
    named. Returns (model for all, {arm: model})."""
    every, per = None, {}
    for v in values or []:
        name, sep, model = v.partition("=")
        if sep:
            if name.strip() not in arms or not model.strip():
                raise ModelChoiceError(f"--model {v!r}: expected ARM=MODEL with ARM an endpoint "
                                       f"arm ({', '.join(arms) or 'none'}), or a bare MODEL")
            per[name.strip()] = model.strip()
        elif every is None:
            every = v.strip()
        else:
            raise ModelChoiceError(f"--model {v!r}: a model for every endpoint is already given "
                                   f"({every!r}); use ARM=MODEL (arms: {', '.join(arms)})")
    return every, per
