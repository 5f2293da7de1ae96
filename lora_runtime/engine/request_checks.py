"""What an engine can never serve: a request is checked before it is queued, and a refused one
changes nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from lora_runtime.checks import is_int

if TYPE_CHECKING:
    from lora_runtime.engine.requests import Request
    from lora_runtime.engine.scheduler import SchedulerConfig
    from lora_runtime.lora.manager import LoRAManager
    from lora_runtime.model.config import LlamaConfig


def check_request(req: Request, model: LlamaConfig, kv_tokens: int, scheduler: SchedulerConfig,
                  lora: LoRAManager | None) -> None:
    """Raises ValueError naming the input and the fix where ``req`` could never be served: ids
    outside ``model``'s vocabulary, an adapter ``lora`` has not loaded, more positions than the
    model or a ``kv_tokens``-slot cache holds, a prompt longer than a step without chunked
    prefill."""
    vocab = model.vocab_size
    if min(req.prompt) < 0 or max(req.prompt) >= vocab:
        at = [i for i, t in enumerate(req.prompt) if not 0 <= t < vocab][:5]
        raise ValueError(f"prompt token ids {[req.prompt[i] for i in at]} at positions {at} "
                         f"are outside the vocabulary 0..{vocab - 1} of this model: "
                         "tokenize with the model's tokenizer")
    # A stop id no token can match (another tokenizer's end-of-sequence id) would let the
    # request run to max_new_tokens without a word.
    bad_stops = [t for t in req.stop_ids if not 0 <= t < vocab]
    if bad_stops:
        raise ValueError(f"stop_ids {bad_stops[:5]} are outside the vocabulary "
                         f"0..{vocab - 1} of this model, so they could never stop the "
                         "request: take them from the model's tokenizer")
    if req.adapter is not None and not isinstance(req.adapter, str):
        raise ValueError(f"adapter must be an adapter's name (str), or None for the base "
                         f"model, got {req.adapter!r}")
    if req.adapter is not None and lora is None:
        raise ValueError(f"adapter {req.adapter!r}: this engine's runner has no LoRA "
                         "manager, so it serves the base model only (adapter=None); build "
                         "the ModelRunner with a LoRAManager to serve adapters")
    if req.adapter is not None and req.adapter not in lora.adapters:
        loaded = sorted(lora.adapters)
        raise ValueError(f"unknown adapter {req.adapter!r} (loaded: {loaded}). Load it with "
                         "Engine.load_adapter first, or pass adapter=None for the base model")
    positions = model.max_position_embeddings
    if req.kv_budget > positions:
        raise ValueError(
            f"the request reaches position {req.kv_budget - 1} (prompt {len(req.prompt)} + "
            f"max_new_tokens {req.max_new_tokens} - 1 tokens) but the model has "
            f"max_position_embeddings = {positions}. Shorten the prompt or lower "
            "max_new_tokens")
    if req.kv_budget > kv_tokens:
        raise ValueError(
            f"the request needs {req.kv_budget} KV-cache slots (prompt {len(req.prompt)} + "
            f"max_new_tokens {req.max_new_tokens} - 1) but the cache holds "
            f"{kv_tokens}. Shorten it, or build the engine with a larger KV cache")
    if not scheduler.chunked_prefill and len(req.prompt) > scheduler.max_step_tokens:
        raise ValueError(
            f"the prompt has {len(req.prompt)} tokens but a step takes at most "
            f"{scheduler.max_step_tokens} and chunked prefill is off. Enable "
            "SchedulerConfig.chunked_prefill or raise max_step_tokens")


def check_batch_lists(prompts, adapters) -> None:
    """Raises ValueError naming the fix where ``add_requests`` is not given a list of prompts
    and a list of adapters, one a prompt (a string would be read one adapter a letter; None,
    meant as the base model for all, or a generator failed on ``len`` naming neither)."""
    if _is_one_prompt(prompts):
        # Read as one prompt a token: "3 prompts but 1 adapters", and with [None] * 3
        # "prompt 0 ... got 5".
        raise ValueError(f"add_requests: prompt_ids must be a sequence of token ids for each "
                         f"prompt, but prompts is one prompt's token ids ({type(prompts).__name__}"
                         f" {prompts!r:.60}): pass [prompt] (or add_request(prompt))")
    if not all(isinstance(x, Sized) and not isinstance(x, (str, bytes))
               for x in (prompts, adapters)):
        fix = ("for the base model: [None] * len(prompts)" if adapters is None else
               "for one adapter: [name] * len(prompts)" if isinstance(adapters, str) else
               "for one prompt: add_request" if isinstance(prompts, (str, bytes)) else
               "pass lists, e.g. list(prompts)")
        raise ValueError("add_requests takes a list of prompts and a list of adapter names, "
                         f"one a prompt; got {type(prompts).__name__} prompts and "
                         f"{type(adapters).__name__} adapters ({fix})")
    for what, x in (("prompts", prompts), ("adapters", adapters)):
        # Paired by position: a set's order is not the caller's (adapters {None, "sql"} gave
        # the first prompt whichever the set iterated first), a mapping's items are its keys.
        if what == "prompts" and isinstance(x, Mapping) and "input_ids" in x:
            raise ValueError(f"prompts is a tokenizer's output ({type(x).__name__} of "
                             f"{list(x)}): pass its token ids, one list a prompt, e.g. "
                             "tokenizer(texts)['input_ids']")
        if isinstance(x, (AbstractSet, Mapping)):
            raise ValueError(f"{what} is a {type(x).__name__}: add_requests pairs prompts with "
                             f"adapters by position, and a {type(x).__name__}'s order is not "
                             "the one they were given in: pass a list (of a dict's values: "
                             "list(d.values()))")
    if len(prompts) != len(adapters):
        raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters: pass one "
                         "adapter (or None) a prompt")


def _is_one_prompt(prompts) -> bool:
    """Whether ``prompts`` is one prompt's ids: a 1-D tensor or array (a tokenizer's
    ``input_ids[0]``), or a sequence whose first entry is an id."""
    if hasattr(prompts, "ndim") and not isinstance(prompts, Sequence):
        return prompts.ndim == 1 and prompts.dtype != object  # not an array of lists
    return (isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes))
            and len(prompts) > 0 and is_int(prompts[0]))
