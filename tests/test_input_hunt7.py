"""Inputs a review found served wrong, refused unnamed or crashing: a ``bytearray`` prompt was
served as token ids (its bytes), and text or a tokenizer's output was refused without naming
the fix (tokenize, pass ``input_ids``); ``init_dp`` / ``shutdown`` given a device name
("cpu") raised ``'str' object has no attribute 'type'``, ``shutdown`` before leaving the group
(its peers waited out the timeout); ``random_adapter`` read one target name as a sequence of
letters; ``LoRAManager.load_adapter(name, adapter)`` kept the adapter's own name, so its
errors and the stored adapter named another adapter than the one the caller loaded."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE
from engine_world import EngineWorld
from runtime_helpers import make_runtime

from lora_runtime.dp.group import init_dp, shutdown
from lora_runtime.dp.launch import spawn
from lora_runtime.engine.scheduler import SchedulerConfig
from lora_runtime.lora.adapters import AdapterError, random_adapter
from lora_runtime.model.config import tiny


@functools.cache
def _world() -> EngineWorld:
    return EngineWorld("torch", DEVICE, layers=1, slots=2, kv_tokens=40)


@pytest.mark.parametrize("prompt", [bytearray(b"\x01\x02\x03"), b"\x01\x02",
                                    memoryview(b"\x01\x02"), "hello"])
def test_a_text_or_bytes_prompt_is_refused_naming_the_tokenizer(prompt):
    eng = _world().engine(SchedulerConfig(max_batch_size=4))
    with pytest.raises(ValueError, match=r"prompt_ids .*tokenizer\(text\)\['input_ids'\]"):
        eng.add_request(prompt)
    with pytest.raises(ValueError, match=r"prompt 1: prompt_ids .*tokenizer\(text\)"):
        eng.add_requests([[1, 2], prompt], [None, None])
    assert not eng.has_work


def test_bytearray_stop_ids_are_refused_not_read_as_ids():
    eng = _world().engine(SchedulerConfig(max_batch_size=4))
    with pytest.raises(ValueError, match="stop_ids .*token ids"):
        eng.add_request([1, 2], stop_ids=bytearray(b"\x02"))
    assert not eng.has_work


def _batch_encoding():
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1]})


@pytest.mark.parametrize("encoding", [lambda: {"input_ids": [1, 2, 3], "attention_mask": [1] * 3},
                                      _batch_encoding])
def test_a_tokenizers_output_is_refused_naming_its_input_ids(encoding):
    eng = _world().engine(SchedulerConfig(max_batch_size=4))
    with pytest.raises(ValueError, match=r"prompt_ids .*\['input_ids'\]"):
        eng.add_request(encoding())
    assert not eng.has_work


def test_a_tokenizers_batch_output_given_as_prompts_names_its_input_ids():
    eng = _world().engine(SchedulerConfig(max_batch_size=4))
    batch = {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}
    with pytest.raises(ValueError, match=r"prompts .*tokenizer\(texts\)\['input_ids'\]"):
        eng.add_requests(batch, [None, None])
    assert not eng.has_work


# -- dp/group.py: a device name -------------------------------------------------------------
def _joins_and_leaves_by_device_name(rank: int, out_dir: str) -> None:
    dp = init_dp("cpu")
    shutdown("cpu")
    Path(out_dir, str(rank)).write_text(f"{dp.size} {dist.is_initialized()} {dp.closed}")


def test_init_dp_and_shutdown_take_a_device_name(tmp_path):
    spawn(_joins_and_leaves_by_device_name, 2, str(tmp_path), timeout_s=20)
    assert [Path(tmp_path, str(r)).read_text() for r in range(2)] == ["2 False True"] * 2


@pytest.mark.parametrize("device", [None, 2.5, "nowhere"])
def test_a_bad_device_is_refused_before_any_group_work(monkeypatch, device):
    """Refused before torchrun's environment is read, or the store is met."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"init_dp: device must be a torch.device .*'cpu'"):
        init_dp(device)
    with pytest.raises(ValueError, match=r"shutdown: device must be a torch.device"):
        shutdown(device)


def test_shutdown_by_device_name_outside_a_group_returns():
    assert not dist.is_initialized()
    shutdown("cpu")


# -- random_adapter: one target name ---------------------------------------------------------
def test_random_adapter_refuses_one_target_name_naming_the_fix():
    with pytest.raises(ValueError, match=r"targets .*\('q_proj',\)"):
        random_adapter(tiny(1), "x", 4, "q_proj")


def test_random_adapter_reads_a_generator_of_targets_once():
    ad = random_adapter(tiny(1), "x", 4, (t for t in ("q_proj", "v_proj")))
    assert ad.target_modules == ("q_proj", "v_proj") and ad.targets == {"q_proj", "v_proj"}


# -- LoRAManager.load_adapter: the load name ------------------------------------------------
def test_an_adapter_is_stored_and_named_under_its_load_name():
    runner = make_runtime(tiny(1), dtype=torch.float32, device=DEVICE, slots=2, max_rank=4,
                          targets=("q_proj",), kv_tokens=16)
    lora, cfg = runner.lora, runner.model.config
    ad = random_adapter(cfg, "x", 4, ("q_proj",))
    lora.load_adapter("sql", ad)
    assert lora.adapters["sql"].name == "sql" and ad.name == "x"
    too_big = random_adapter(cfg, "x", 8, ("q_proj",))
    with pytest.raises(AdapterError, match="adapter 'chat'") as e:
        lora.load_adapter("chat", too_big)
    assert "'x'" not in str(e.value) and too_big.name == "x"
    assert sorted(lora.adapters) == ["sql"]
