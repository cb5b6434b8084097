"""`fidelity serve`: the reference model under one or more arms as a stand-in engine that
speaks OpenAI's, vLLM's and SGLang's wire formats, so the same HTTP clients (needle
sweeps, KLD over HTTP, lm-eval, the `openai` package) measure golden, any toggle arm and
a real SGLang/vLLM deployment alike. Modules: engine (arms, models, captures), scheduler
(round-robin decode steps, cancellation, bounded queue), openai_api, sglang_api, ops_api
(tokenize, health, info), tool_calls (DSML tool calls read out of an answer, V4 and V4.1
tags), app (routes and errors)."""
from .app import create_app
from .engine import Engine, GenerationRequest, ServeOptions, parse_arm_options

__all__ = ["Engine", "GenerationRequest", "ServeOptions", "create_app", "parse_arm_options"]
