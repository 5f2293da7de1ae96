"""A tiny serving world for engine tests: an engine (optionally with captured graphs) and a
separate reference runtime over identical base weights that runs any request alone."""

from __future__ import annotations

import torch
from runtime_helpers import ALL_TARGETS, drawn_adapter, make_runtime

from graphs import GraphRunner
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.requests import Request, build_decode, build_extend, release
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.lora.adapters import LoRAAdapter
from lora_runtime.model.config import tiny

DECODE_BUCKETS, PREFILL_BUCKETS = [1, 2, 4, 8], [8, 16, 32]
MAX_CONTEXT, MAX_PREFILL_REQUESTS, MAX_PREFIX = 48, 4, 96
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.1}


class EngineWorld:
    def __init__(self, backend: str, device, *, dtype=torch.float32, layers: int = 2,
                 slots: int = 2, kv_tokens: int = 160, graphs: bool = False) -> None:
        self.device, self.dtype, self.slots = device, dtype, slots
        self.config = tiny(layers)
        self.runner = make_runtime(self.config, dtype=dtype, device=device, backend=backend,
                                   slots=slots, max_rank=8, targets=ALL_TARGETS,
                                   kv_tokens=kv_tokens)
        self.lora = self.runner.lora
        # bf16: the same kernels alone (Triton and torch bf16 round differently)
        ref_backend = "torch" if dtype == torch.float32 else backend
        self.ref = make_runtime(self.config, dtype=dtype, device=device, backend=ref_backend,
                                slots=1, max_rank=8, targets=ALL_TARGETS, kv_tokens=256)
        self.graphs = []
        if graphs:
            self.graphs = [
                GraphRunner.decode(self.runner, DECODE_BUCKETS, MAX_CONTEXT).capture(),
                GraphRunner.prefill(self.runner, PREFILL_BUCKETS, MAX_PREFILL_REQUESTS,
                                    MAX_PREFIX).capture(),
            ]
        self.adapters: dict[str, LoRAAdapter] = {}
        self.serial = 0

    def engine(self, config: SchedulerConfig, overlap: bool = False) -> Engine:
        """A fresh engine over the world's runtime (cache empty, no adapter loaded)."""
        self.lora.reset_lora_batch()
        self.runner.kv.reset()
        # Built first: the manager then sees its requests (none), not the last engine's.
        eng = Engine(self.runner, config, self.graphs, keep_logits=True, overlap=overlap)
        for name in list(self.lora.adapters):
            self.lora.unload_adapter(name)
        return eng

    def new_adapter(self, engine: Engine, pinned: bool = False) -> str:
        name = f"ad{self.serial}"
        ad = drawn_adapter(self.config, name, self.serial, max_rank=8)
        self.serial += 1
        engine.load_adapter(name, ad, pinned=pinned)
        self.adapters[name] = ad
        return name

    def alone(self, req: Request) -> list[torch.Tensor]:
        return run_alone(self.ref, self.adapters, req.prompt, req.adapter, req.output)

    def check_request(self, engine: Engine, req: Request) -> int:
        """Every logits row equals the request run alone; each greedy token equals the
        alone run's where the top-2 margin is clear. Returns the tokens compared."""
        return compare_with_alone(engine.logits[req.id], self.alone(req), req.output,
                                  self.dtype, f"request {req.id} ({req.adapter})")


@torch.no_grad()
def run_alone(ref, adapters: dict, prompt, adapter, output) -> list[torch.Tensor]:
    """A request run by itself on the runtime ``ref``, fed ``output`` (the tokens another run
    sampled): its logits at every position where a token was sampled."""
    lora, kv, device = ref.lora, ref.kv, ref.device
    lora.reset_lora_batch()
    for name in list(lora.adapters):
        lora.unload_adapter(name)
    if adapter is not None:
        lora.load_adapter(adapter, adapters[adapter])
    solo = Request(list(prompt), adapter, len(output))
    out = [ref.forward_eager(build_extend([solo], kv, device))[0].clone()]
    for tok in output[:-1]:
        solo.output.append(tok)
        out.append(ref.forward_eager(build_decode([solo], kv, device))[0].clone())
    release([solo], kv)
    return out


def compare_with_alone(got, want, output, dtype, what: str) -> int:
    """Logits rows equal (by dtype); greedy tokens equal where the top-2 margin is clear.
    Returns how many tokens were compared."""
    assert len(got) == len(want) == len(output), (what, len(got), len(want), len(output))
    tol = TOL[dtype]
    compared = 0
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol,
                                       msg=lambda m, k=k: f"{what} token {k}: {m}")
        else:  # bf16: another batch shape sums in another order; judge the whole row
            rel = float((g.float() - w.float()).norm() / w.float().norm())
            assert rel < tol, f"{what} token {k}: relative error {rel:.3g} >= {tol}"
        top2 = w.topk(2).values
        if float(top2[0] - top2[1]) > MARGIN[dtype]:
            assert output[k] == int(w.argmax()), f"{what} token {k}"
            compared += 1
    return compared


def stream_through(engine: Engine, fault: type[BaseException], max_calls: int = 200
                   ) -> tuple[dict[int, list[int]], int]:
    """Calls ``step()`` until the engine has no work, as a streaming client does: each
    request's tokens as ``step()`` returned them (by request id), and how many calls raised
    ``fault`` (caught, serving goes on)."""
    streamed: dict[int, list[int]] = {}
    raised = calls = 0
    while engine.has_work:
        calls += 1
        assert calls <= max_calls, "the engine never drained"
        try:
            for req, token in engine.step():
                streamed.setdefault(req.id, []).append(token)
        except fault:
            raised += 1
    return streamed, raised
