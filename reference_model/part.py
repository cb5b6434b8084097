"""The base of a model's version parts (reference_model/version.py): each holds its model and
reads the model's config and numerics when it runs, so an arm's Numerics is always the one
in use."""
from __future__ import annotations


class ModelPart:
    def __init__(self, model):
        self.m = model                      # the model (anything with `.cfg` and `.nx`)

    @property
    def cfg(self):
        return self.m.cfg

    @property
    def nx(self):
        return self.m.nx
