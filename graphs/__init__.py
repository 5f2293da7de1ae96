"""Capture and replay of model forwards (decode bucketed by batch size, prefill by token
count) whose replays read only static buffers refreshed in place: CUDA graphs on a GPU, a
traced replay (make_fx) on a CPU that bakes in what a CUDA graph bakes in."""

from graphs.runner import GraphRunner, GraphStats
from graphs.static_batch import DecodeBuffers, PrefillBuffers

__all__ = ["DecodeBuffers", "GraphRunner", "GraphStats", "PrefillBuffers"]
