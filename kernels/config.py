"""Launch shapes chosen from tensor shapes only (never from per-batch values), so an eager call
and a captured graph of the same bucket make the same choice."""

from __future__ import annotations

import functools
import os
import sys

import torch

from kernels.traced_op import tracing


def cdiv(a: int, b: int) -> int:
    """Host-side ``triton.cdiv`` (Triton's is a jit function: ~15 us a call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side ``triton.next_power_of_2`` (same reason)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _int_env(env: str, default: str) -> int:
    """A tuning variable's integer (read at import), or an error naming it."""
    text = os.environ.get(env, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{env}={text!r}: give an integer, e.g. {env}={default}") from None


def _pow2_problem(value: int, most: int | None = None) -> str | None:
    if value < 16 or value & (value - 1) or (most is not None and value > most):
        return "give a power of two >= 16" + ("" if most is None else f" and at most {most}")
    return None


def _maxnreg_problem(value: int) -> str | None:
    if value != 0 and not 32 <= value <= 255:
        return "give 0 (the compiler's choice) or a register count from 32 to 255"
    return None


KNOB_PROBLEMS = {
    "ROPE_WIDE_WINDOW": lambda v: _pow2_problem(v, 128),  # v/4 warps: at most 32 a program
    "ROW_SHRINK_ELEMENTS": _pow2_problem,
    "WIDE_MAXNREG": _maxnreg_problem,
}
"""What is wrong with a value of a knob that only some values of its type can take (None:
nothing): a bad one compiled on the GPU and failed there, in ptxas. Checked when the
environment sets the knob and for ``bench.route_ab``'s variants."""


def _checked_env(knob: str, env: str, default: str, example: str | None = None) -> int:
    """``_int_env`` refused where ``KNOB_PROBLEMS[knob]`` finds a problem."""
    value = _int_env(env, default)
    problem = KNOB_PROBLEMS[knob](value)
    if problem:
        raise ValueError(f"{env}={value}: {problem}, e.g. {env}={example or default}")
    return value


@functools.cache
def interpreted() -> bool:
    """Read once: Triton picks the interpreter when a kernel is decorated, at import."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_wanted(device: torch.device) -> int:
    """Enough programs to cover every SM a few times over (decode kernels are latency-bound)."""
    if device.type != "cuda":
        return 4
    return 4 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def rank_block(max_rank: int) -> int:
    return max(16, next_pow2(max_rank))


def shrink_k_block(block_r: int, k: int) -> int:
    # One stage of the A tile stays within 32 KB of shared memory.
    cap = 256 if block_r <= 32 else (128 if block_r <= 64 else 64)
    return max(16, min(cap, next_pow2(k)))


def one_launch_k_block(block_r: int, block_m: int, k: int, elt: int, programs: int,
                       device: torch.device) -> int:
    """K columns a one-launch program's shrink loads a step (``kernels.shrink_expand``). Each
    program walks the whole K alone, so a grid within one wave of the device (a few rows'
    module) is bound by the walk's steps: it takes the widest step whose x and A tiles stay
    within 64 KB (three pipeline stages in the SM's shared memory), up to 1024 columns. A
    larger grid keeps ``shrink_k_block`` (its programs share the SMs). H100, the launch
    alone in a graph, us at 256 / 512 / 1024 columns: T=1 down 29.8 / 22.3 / 20.8, qkv 10.5 /
    8.4 / 8.3, o_proj 10.1 / 8.2 / 8.2, gate_up (224 programs) 13.0 / 12.7 / 15.7; T=16 with
    8 adapters (256 programs and more) gate_up 38.3 / 50.2 / 55.1, down 38.7 / 36.7 / 40.8."""
    step = shrink_k_block(block_r, k)
    if programs > programs_wanted(device) // 4:  # more than one program an SM
        return step
    while step < min(1024, next_pow2(k)) and (block_m + block_r) * 2 * step * elt <= 65536:
        step *= 2
    return step


SHRINK_PROGRAMS = _int_env("MULTILORA_SHRINK_PROGRAMS", "0")
"""Programs the shrink's K split aims for (0: ``programs_wanted``). Read at import; A/B runs."""


SHRINK_JOINT_MIN_ROWS = _int_env("MULTILORA_SHRINK_JOINT_MIN_ROWS", str(sys.maxsize))
"""A shrink of several slices (qkv, gate_up) over an extend layout of at least this many rows
runs one program a block for all slices, so each x tile is read once instead of once a slice
(read at import; the default, a huge value: never, until timed on a GPU)."""


def joint_shrink(rows: int, layout_block_m: int, num_slices: int, max_rank: int,
                 elt: int) -> bool:
    """Hazard: the joint program's A tile (``rank_block(num_slices * max_rank)`` rows of a
    ``shrink_k_block`` step, 64 columns past 128 rows) of ``elt``-byte elements must fit an
    SM's shared memory over the compiler's pipeline stages. sm_90, 64-row blocks, qkv: r=128
    fp16 (512 rows) 216 KB; r=256 fp16 (1,024) 408 KB and r=128 fp32 (512) 288 KB, against
    227 KB an SM, fail to launch ("out of resource: shared memory"): wider weights keep a
    program a slice."""
    return (num_slices > 1 and rows >= SHRINK_JOINT_MIN_ROWS and layout_block_m >= 64
            and rank_block(num_slices * max_rank) * elt <= 1024)


EAGER_SHRINK_SPLITS = _int_env("MULTILORA_EAGER_SHRINK_SPLITS", "1")
"""At most this many K splits for a shrink launched eagerly on a GPU (0: no limit; read at
import). A split shrink adds into a zeroed output: one memset launch more, and an eager
forward is bound by its launches' host time (~50-100 us each on the H200 host). H200, 4
layers, 16 adapters r=16, eager prefill LoRA / base traffic, two alternating rounds: 4 x 256
tokens 1.77 / 1.59x split, 1.39 / 1.39x unsplit (the shrinks' device time 140 -> 228 us a
forward); 8 x 256 (device-bound) 1.29 / 1.34x against 1.35 / 1.37x, its device time
unchanged (5,880 / 5,900 against 5,889 / 5,879 us). In a graph the memset sits on the side
branch and costs nothing measurable (``docs/perf-notes.md``, session 26)."""


def shrink_split(
    k: int, block_k: int, num_programs: int, device: torch.device, split_k: int | None,
    eager: bool = False,
) -> tuple[int, int]:
    """(splits, k_per_split): split K until the grid covers the device, each split a multiple
    of ``block_k``; an ``eager`` launch on a GPU at most ``EAGER_SHRINK_SPLITS`` times.
    ``split_k`` forces a split count (tests)."""
    k_blocks = -(-k // block_k)
    if split_k is None:
        wanted = SHRINK_PROGRAMS or programs_wanted(device)
        split_k = -(-wanted // max(1, num_programs))
        if device.type == "cuda" and num_programs * 2 >= programs_wanted(device) // 4:
            # A grid that already fills the device gains little from splitting (prefill
            # qkv, H200: 2 splits 18.4 us, 4 splits 21-26 us, 6 splits 23.4 us).
            split_k = min(split_k, 2)
        if eager and device.type == "cuda" and EAGER_SHRINK_SPLITS > 0:
            split_k = min(split_k, EAGER_SHRINK_SPLITS)
    split_k = max(1, min(split_k, k_blocks))
    k_per_split = -(-k_blocks // split_k) * block_k
    return -(-k // k_per_split), k_per_split


def expand_n_block(max_width: int, block_m: int, block_r: int, one_launch: bool = False) -> int:
    # 64 rows x 128 columns took 255 registers a thread while y's accesses were scalar; with
    # them vectorized (``LoRAWeights.column_align``) 126, and 128 columns beat 64 at prefill
    # (H200, T=2048, block_m 64: gate_up 72.5 against 85.8 us, o_proj 13.4 against 14.7).
    # The one-launch kernel keeps 64 for 64-row blocks (its shrink's registers; not re-measured).
    # Decode blocks at rank block 16 take 64 columns over one warp (``expand_warps``).
    cap = 64 if (one_launch and block_m >= 64) or _one_warp_tiles(block_m, block_r,
                                                                   one_launch) else 128
    return max(16, min(cap, next_pow2(max_width)))


def _one_warp_tiles(block_m: int, block_r: int, one_launch: bool) -> bool:
    return block_m < 64 and block_r <= 16 and not one_launch


def expand_warps(block_m: int, block_n: int, block_r: int, one_launch: bool = False) -> int:
    """An expand program's warps. Decode blocks (16 rows) at rank block 16 take one warp for
    their 16 x 64 tile: with B and y in 16-byte vectors a warp moves the tile in a few
    instructions, and more programs fit beside each other. H200, expand alone in graphs, us,
    128 columns over 4 warps (before) / 64 columns over 1 warp: gate_up T=16 8 adapters
    6.98 / 5.80, qkv 3.62 / 3.45, o_proj 3.46 / 3.22, down 3.44 / 3.23, gate_up T=64 7.95 /
    6.95, gate_up T=256 64 adapters 32.8 / 28.5, qkv 9.57 / 8.51; at rank 64 one warp lost
    (gate_up T=64 15.2 / 18.5), so larger rank blocks keep ``num_warps``. Hazard: that sweep
    launched its candidates without PDL; the kernel suite (PDL, after the GEMM) saw less:
    gate_up T=16 7.0 / 6.8, T=64 7.9 / 7.5, T=256 64 adapters 32.5 / 30.2, the others equal."""
    if _one_warp_tiles(block_m, block_r, one_launch) and block_n <= 64:
        return 1
    return num_warps(block_m, block_n)


def expand_tiles_per_program(
    num_blocks: int, slice_tiles: tuple[int, ...], block_m: int, block_r: int,
    device: torch.device, tiles: int | None, one_launch: bool = False
) -> int:
    """Output tiles one expand program walks, reusing its ``a`` tile (``BLOCK_M x BLOCK_R``
    fp32, half a ``BLOCK_M x 128`` y tile's read and write at rank 64): at prefill (blocks of
    64 rows) 4 from rank block 32 while the grid still fills the device twice, else 1. H200,
    T=2048, 128-column tiles, 1 / 4 tiles: r=64 gate_up 117.2 / 100.6 us, qkv 29.1 / 24.0,
    o_proj 21.5 / 19.0; r=16 gate_up 72.5 / 72.7, qkv 18.5 / 18.4; at T=512 with 8 blocks
    (under one wave at 4) gate_up r=16 22.0 / 26.6. Decode blocks (16 rows), 1 / 2 / 4 tiles:
    gate_up T=64 r=64 18.0 / 18.2 / 22.2, qkv T=64 r=64 6.0 / 7.6 / 10.2, gate_up T=64 r=16
    8.7 / 7.8 / 10.1. The one-launch kernel (``one_launch``): ``one_launch_tiles``."""
    if tiles is None and one_launch:
        return one_launch_tiles(num_blocks, slice_tiles, device)
    if tiles is None:
        waves = num_blocks * sum(slice_tiles) // max(1, programs_wanted(device))
        tiles = 4 if block_m >= 64 and block_r >= 32 and waves >= 2 else 1
    tiles = max(1, min(ONE_LAUNCH_MAX_TILES if one_launch else 4, tiles))
    return 1 << (tiles.bit_length() - 1)


ONE_LAUNCH_MAX_TILES = 8


def one_launch_tiles(num_blocks: int, slice_tiles: tuple[int, ...],
                     device: torch.device) -> int:
    """Output tiles a one-launch program walks: the fewest (a power of two, at most
    ``ONE_LAUNCH_MAX_TILES``) that bring the grid (``num_blocks`` x each slice's groups of
    its ``slice_tiles``) within one program an SM. Every program
    recomputes its block's shrink over the whole K, so each program fewer saves a walk, and a
    grid within one wave also takes the wide K step (``one_launch_k_block``). H100, the launch
    alone in a graph, 8 adapters r=16 at T=16 (8 blocks; T=64 the same within 0.4 us), us at
    1 / 2 / 4 / 8 tiles a program (programs at 1): down 37.7 / 20.7 / 21.7 / 23.9 (256), o_proj
    12.6 / 9.1 / 10.3 / 12.5 (256), qkv 17.4 / 13.3 / 10.5 / 12.9 (384), gate_up - / 38.7
    / 24.4 / 17.0 (1,792; 2 tiles before, the grid covering the device three times)."""
    sms = max(1, programs_wanted(device) // 4)
    tiles = 1
    num_tiles = max(slice_tiles)  # more tiles than the widest slice's cut no group
    # Groups counted slice by slice, as the launch's are: none straddles two slices.
    while (tiles < ONE_LAUNCH_MAX_TILES and tiles < num_tiles
           and num_blocks * sum(cdiv(n, tiles) for n in slice_tiles) > sms):
        tiles *= 2
    return tiles


def num_warps(block_m: int, block_cols: int) -> int:
    return 8 if block_m * block_cols > 8192 else 4


FUSED_EXPAND_MIN_ROWS = _int_env("MULTILORA_FUSED_EXPAND_MIN_ROWS", "64")
"""gate_up's expand runs inside SwiGLU's activation (``kernels.lora_epilogue``) for forwards of
at least this many rows (read at import; 0: always, a huge value: never). H200, one graph per
case, gate_up + activation, LoRA's added share of the base: T=1 5.2% separate / 4.7% fused,
T=16/8 adapters 13.3 / 21.9%, T=32/16 32.0 / 32.5%, T=64/8 15.9 / 10.9%, T=128/16 28.2 /
22.4%, T=256/64 62.6 / 40.8%: below 64 rows the expand's own grid spreads B over more SMs."""


ROW_EPILOGUE_MAX_ROWS = {
    "rope": _int_env("MULTILORA_ROPE_EPILOGUE_MAX_ROWS", "63"),
    "silu_mul": _int_env("MULTILORA_SILU_EPILOGUE_MAX_ROWS", "63"),
    "norm": _int_env("MULTILORA_NORM_EPILOGUE_MAX_ROWS", "-1"),
}
"""Forwards of at most this many rows add qkv's LoRA term in RoPE with the KV write ("rope"),
gate_up's in SwiGLU's activation ("silu_mul") and o_proj's and down's in the residual add +
RMSNorm after them ("norm") with a program per row (``kernels.lora_epilogue``;
read at import, -1: never). At decode the separate expand is a launch on the critical path after
the base GEMM; it was most of LoRA's cost in a graph step (see docs/perf-notes.md)."""


NORM_ROWS_SPLIT = os.environ.get("MULTILORA_NORM_ROWS_SPLIT", "1") != "0"
"""Inside a graph capture or a trace, the norm's pending term by rows (``"norm"`` above) runs
with each row split over column groups (``kernels.rms_norm_split``): the row's B loads spread
over many SMs, the last program of the row normalises it. Eager forwards keep a program per
row (read at import; 0: a program per row everywhere)."""


def norm_rows_split(x: torch.Tensor) -> bool:
    return NORM_ROWS_SPLIT and not eager(x)


EAGER_EPILOGUE_MAX_ROWS = _int_env("MULTILORA_EAGER_EPILOGUE_MAX_ROWS", "1024")
EAGER_EPILOGUE_ROW_RANKS = _int_env("MULTILORA_EAGER_EPILOGUE_ROW_RANKS", "16384")
"""Eager forwards of at most ``EAGER_EPILOGUE_MAX_ROWS`` rows, rows x ``rank_block(max_rank)``
at most ``EAGER_EPILOGUE_ROW_RANKS``, leave qkv's and o_proj's and down's expand to RoPE and the
residual add + RMSNorm by rows too (read at import; 0: never): an eager step past the
consumer-shrink budget is bound by its launches' host time (~50-80 us a LoRA launch on the
H200 host), and this takes one launch a module off. Each row reads its adapter's B, so the GPU
work grows with rows x rank. H200, 4 layers, 16 adapters, eager LoRA over eager base, off /
on: decode bs 256 r=64 2.06-1.99 / 1.89-1.90x, 8/16/64 pool 2.00-1.95 / 1.87-1.91x; prefill
1024 tokens r=16 1.93-1.58 / 1.75-1.41x, 256 tokens 8/16/64 1.96 / 1.84x; but 1024 tokens of
the 8/16/64 pool 1.45 / 2.03x (kernels 3.7 -> 6.0 ms) and 2048 tokens r=16 1.24-1.38 /
1.39x."""


def fused_expand(rows: int) -> bool:
    return rows >= FUSED_EXPAND_MIN_ROWS


WIDE_BLOCKS_MIN_ROWS = _int_env("MULTILORA_WIDE_BLOCKS_MIN_ROWS", "256")
WIDE_BLOCK = (32, 128, 4)
"""SwiGLU adds a pending term by blocks of ``WIDE_BLOCK`` = (rows, columns, warps) for
forwards of at least ``WIDE_BLOCKS_MIN_ROWS`` rows (read at import; a huge value: never), by
16-row blocks below. A block loads B's tile once per distinct slot it holds, so 16-row blocks
of long segments load it once per 16 rows, as many bytes as the gate and up tiles they add
it to; a wider block of several slots loads no more B than its 16-row parts would. H200,
4 layers, 16 adapters r=16, prefill graphs, the kernel's time a forward (profiler, one
stream), 16 x 128 / 64 x 64 / 32 x 128: 256 tokens 62.3 / 59.3 / 57.5 us, 1024 tokens
224 / 201 / 191, 2048 tokens 438 / 398 / 383 (plain SwiGLU 23 / 82 / 166). 64 x 128 over
8 warps lost at 256 tokens."""


WIDE_MAXNREG = _checked_env("WIDE_MAXNREG", "MULTILORA_WIDE_MAXNREG", "0", "128")
"""Registers a thread of SwiGLU's wide-block program may use (0: the compiler's choice). These
programs are bandwidth-bound, and what they hold in flight is what the register file lets
resident: sm_90, 32 x 128 over 4 warps, the compiler takes 133-134 a thread (3 programs an SM);
128 fits 4, for 16 bytes of spills (ptxas; not yet timed on a GPU, so off by default). Read
at import; A/B runs set it."""

def wide_options() -> dict:
    """Launch options of a wide-block consumer program."""
    return {"maxnreg": WIDE_MAXNREG} if WIDE_MAXNREG > 0 else {}


# tl.dot's rows; ``rows / 4`` warps, at most 32 a program (256 rows failed in ptxas).
ROPE_WIDE_WINDOW = _checked_env("ROPE_WIDE_WINDOW", "MULTILORA_ROPE_WIDE_WINDOW", "16")
"""RoPE adds a pending term by windows of this many permuted rows (a power of two from 16 to
128; ``rows / 4`` warps) where ``wide_blocks`` holds (extend layouts of long segments), by
``FUSE_BLOCK_M`` rows over 4 warps elsewhere (decode rows of many adapters put more slots in a
wider window, which it walks in sequence). 32 and 64 read B's head tiles half or a quarter as
often for the same registers per byte in flight (ptxas: 121 at 32 over 8 warps, 108 at 64
over 16); not yet timed on a GPU, so 16 by default. Read at import; A/B runs set it."""


PENDING_SILU_TILES = _int_env("MULTILORA_PENDING_SILU_TILES", "1")
"""Column tiles a by-blocks SwiGLU program adds a pending term to (its rows, slots and ``a``
loaded once for them). Read at import; A/B runs."""


def wide_blocks(rows: int, layout_block_m: int) -> bool:
    """Extend layouts only (blocks of 64 rows: long segments), where it was measured. Decode
    rows of many adapters put several slots in a wide block, whose slot loop then runs
    longer; the H200 model suite saw no difference at decode bs 256 (LoRA replay, wide /
    16-row blocks: 64 adapters 2159 / 2138 us, r=64 1949 / 1963), so decode keeps the
    16-row blocks it was tuned with."""
    return rows >= WIDE_BLOCKS_MIN_ROWS and layout_block_m >= 64


POOL_EPILOGUE_MAX_ROWS = _int_env("MULTILORA_POOL_EPILOGUE_MAX_ROWS", "64")
"""RoPE and SwiGLU also add their term by rows for forwards of at most this many rows when the
pool has at least as many slots as the forward has rows (read at import; 0: never). By rows
each row reads its own adapter's B; by blocks, or in a separate expand, each (block, slot)
pair does: with about one adapter a row both read the same bytes and the by-rows route saves
the expand's launch and its pass over the output. H200, 4 layers, bs 64, r=16, LoRA replay
over base (two rounds, by rows off / on at 64 rows): 64 adapters 37.0-36.9 / 30.2-30.2%,
16 adapters 12.4-12.5 / 12.8-12.9% (so a 16-slot pool keeps the threshold at 63)."""


def row_epilogue(rows: int, consumer: str, num_slots: int = 0) -> bool:
    """Whether ``consumer`` adds a pending term by rows for a forward of ``rows`` rows over a
    pool of ``num_slots`` slots."""
    return rows <= ROW_EPILOGUE_MAX_ROWS[consumer] or (
        consumer != "norm" and rows <= min(num_slots, POOL_EPILOGUE_MAX_ROWS))


def pending_by_rows(x: torch.Tensor, consumer: str, max_rank: int, num_slots: int = 0) -> bool:
    """Whether ``consumer`` adds a pending term (the shrink's ``a``) to ``x``'s rows by rows:
    few rows anywhere (``row_epilogue``), or an eager forward within the
    ``EAGER_EPILOGUE_MAX_ROWS`` limits for RoPE and the norm (SwiGLU takes it by blocks there,
    ``fused_expand``). The projection and its consumer both ask this, of the same rows and
    weights."""
    rows = x.shape[0]
    return row_epilogue(rows, consumer, num_slots) or (
        consumer != "silu_mul" and rows <= EAGER_EPILOGUE_MAX_ROWS
        and rows * rank_block(max_rank) <= EAGER_EPILOGUE_ROW_RANKS and eager(x))


def eager(x: torch.Tensor) -> bool:
    """Neither a CUDA graph capture nor a tracer is recording the kernels on ``x``."""
    return not tracing() and not (x.device.type == "cuda"
                                  and torch.cuda.is_current_stream_capturing())


# Kernels span its K step (this over the rank chunk) and warps with it: a power of two.
ROW_SHRINK_ELEMENTS = _checked_env("ROW_SHRINK_ELEMENTS", "MULTILORA_ROW_SHRINK_ELEMENTS",
                                   "16384")
"""A elements a by-rows consumer's shrink loads a step (read at import). Each step is a
dependent load of one program, so the step count sets the shrink's latency: H200, eager
4-layer forward, 16 adapters r=16, bs 1, with 4096: the residual add + RMSNorm with the term
54 us a call (down's K of 14336 in 56 steps), SwiGLU 40 us, RoPE 25 us; see
docs/perf-notes.md for 16384."""


ROW_RANK_CHUNK = 16
"""Ranks a by-rows shrink computes at a time (``kernels.row_lora``): a row of rank 8 in a pool
whose largest rank is 64 loads one chunk of A, not a 64-rank tile mostly masked."""


@functools.lru_cache(maxsize=256)
def row_shrink_k_block(block_r: int, k: int) -> int:
    """K columns a by-rows consumer's shrink step loads: ``ROW_SHRINK_ELEMENTS`` A elements
    of one chunk of at most ``ROW_RANK_CHUNK`` ranks, at least 128 columns
    (at rank 64 and 4096 elements, 64 columns made down's shrink a chain of 224 steps)."""
    return max(16, min(max(ROW_SHRINK_ELEMENTS // min(block_r, ROW_RANK_CHUNK), 128), next_pow2(k)))


def row_shrink_warps() -> int:
    """Warps of a by-rows consumer program that computes its shrink (its A tile spread over
    them: 64 elements a thread at most)."""
    return max(4, min(16, ROW_SHRINK_ELEMENTS // 2048))


ROW_SHRINK_PROGRAMS = 264
"""Programs a by-rows consumer that computes its shrink aims for (two per H200 SM): where the
rows alone give more, a program serves more of its row with one shrink."""


def rope_heads_per_program(tokens: int, heads: int, kv_heads: int) -> int:
    """Heads of one slice a RoPE program takes when it computes its shrink: the largest of
    1, 2, 4, 8 that still leaves ``ROW_SHRINK_PROGRAMS`` programs. Every program repeats its
    slice's shrink, so at 64 tokens one head a program read A 48 times a token (H200, 16
    adapters r=64: ~170 us a call)."""
    group = 8
    while group > 1 and tokens * (cdiv(heads, group) + cdiv(kv_heads, group)) < (
            ROW_SHRINK_PROGRAMS):
        group //= 2
    return group


def silu_shrink_groups(rows: int) -> int:
    """Column groups of a row in SwiGLU when each program computes the row's shrink (each
    group repeats it: A's two slices): 8, or 4 where that still leaves
    ``ROW_SHRINK_PROGRAMS`` programs."""
    return 4 if rows * 4 >= ROW_SHRINK_PROGRAMS else 8


CONSUMER_SHRINK_MAX_ROWS = _int_env("MULTILORA_CONSUMER_SHRINK_MAX_ROWS", "256")
CONSUMER_SHRINK_MAX_RANK = _int_env("MULTILORA_CONSUMER_SHRINK_MAX_RANK", "64")
CONSUMER_SHRINK_ROW_RANKS = _int_env("MULTILORA_CONSUMER_SHRINK_ROW_RANKS", "4096")
"""Eager forwards of at most ``CONSUMER_SHRINK_MAX_ROWS`` rows, of weights whose largest rank
is at most ``CONSUMER_SHRINK_MAX_RANK``, with rows x ``rank_block(max_rank)`` at most
``CONSUMER_SHRINK_ROW_RANKS``, leave a projection's whole LoRA term, shrink included, to the
kernel that consumes its output, by rows (``kernels.row_lora``: qkv's to RoPE, gate_up's to
SwiGLU, o_proj's and down's to the next norm): no LoRA launch at all. Read at import; 0:
never. Each program's shrink is a serial loop over K (``row_shrink_k_block``), so its latency
grows with the rank; every row reads its adapter's A and B, so the GPU work grows with rows x
rank. H200, 4 layers, 16 adapters, eager LoRA over eager base traffic: r=16 bs 1 / 8 / 32 /
64, route off 1.64 / 1.65 / 1.62 / 1.65x, on 1.41 / 1.43 / 1.43 / 1.59x (first version); r=64
one launch 1.59-1.70x, on with 128-column A tiles 1.45 / 1.45 / 1.37 / 1.42x. Above 64 rows
(probe, limit 64 / raised, r=16): decode bs 256 1.96 / 1.32x, full depth 2.23 / 1.33x;
prefill 256 tokens 1.94 / 1.31x, 1024 tokens 1.92 / 1.57x. Model suite with 1024 rows and a
budget of 16384 (84e773e): prefill 1024 tokens 2.13-2.23x (1.40-1.94x before: the by-rows
kernels bound the step, 6.9 ms of kernels against 3.3), the 8/16/64 pool at bs 256 2.46x
(1.99x), r=64 at bs 256 2.01x (1.96x): hence 256 rows and 4096 (rank <= 16: 256 rows, rank
64: 64). Above rank 64: not measured."""


UNSHRUNK_BLOCKS_MIN_ROWS = {
    "silu_mul": _int_env("MULTILORA_SILU_UNSHRUNK_BLOCKS_MIN_ROWS", "128"),
    "norm": _int_env("MULTILORA_NORM_UNSHRUNK_BLOCKS_MIN_ROWS", "128"),
}
"""From this many rows, where the layout's segment blocks are at most its windows of
``FUSE_BLOCK_M`` permuted rows (about one adapter a window), a consumer computes an unshrunk
term by windows (``kernels.lora_epilogue.block_shrink``: a ``tl.dot`` loop over K per
distinct slot of the window, A read once a window and column group) instead of by rows (A
read once a row and column group). Read at import; SwiGLU and the norm have the by-blocks
shape (the norm under more conditions: ``unshrunk_by_windows``). A
window of many slots runs one serial K loop per slot: H200, 4 layers, 16 adapters, SwiGLU's
kernel time a forward, by rows / by windows (132 programs): r=16 bs 32 111 / 660 us, bs 64
193 / 402, bs 256 541 / 264; r=64 bs 64 695 / 693; full depth 8 adapters bs 256 4320 / 2058
(264 programs: 1552)."""

BLOCK_SHRINK_PROGRAMS = _int_env("MULTILORA_BLOCK_SHRINK_PROGRAMS", "264")
"""Programs a by-windows consumer that computes its shrink aims for (two per H200 SM): each
column group repeats its window's shrink, and each program walks its group's column tiles in
sequence."""

CONSUMER_SHRINK_BLOCKS_MAX_ROWS = _int_env(
    "MULTILORA_CONSUMER_SHRINK_BLOCKS_MAX_ROWS", "1024")
"""Eager forwards of at most this many rows may leave gate_up's whole term to SwiGLU by
windows (``UNSHRUNK_BLOCKS_MIN_ROWS``; rank limit ``CONSUMER_SHRINK_MAX_RANK``): its
recomputation grows with rows, not rows x rank."""


def unshrunk_by_blocks(rows: int, consumer: str, segment_blocks: int) -> bool:
    """Whether ``consumer`` computes an unshrunk term of ``rows`` rows, whose layout has
    ``segment_blocks`` blocks, by windows of ``FUSE_BLOCK_M`` permuted rows."""
    return (rows >= UNSHRUNK_BLOCKS_MIN_ROWS.get(consumer, sys.maxsize)
            and segment_blocks <= cdiv(rows, 16))


def block_shrink_groups(blocks: int, tiles: int) -> int:
    """Column groups of a by-windows consumer that computes its shrink:
    ``BLOCK_SHRINK_PROGRAMS`` programs over ``blocks`` windows, at most one a column tile."""
    return max(1, min(tiles, cdiv(BLOCK_SHRINK_PROGRAMS, blocks)))


def block_shrink_k_block(block_r: int, k: int) -> int:
    """K columns a by-windows shrink step loads: an A tile of 8192 elements (few steps: each
    is a dependent load of one program)."""
    return max(16, min(max(64, 8192 // block_r), next_pow2(k)))


def unshrunk_by_rows(rows: int, max_rank: int) -> bool:
    """Whether an unshrunk term of ``rows`` rows is within the by-rows budget."""
    return (rows <= CONSUMER_SHRINK_MAX_ROWS
            and rows * rank_block(max_rank) <= CONSUMER_SHRINK_ROW_RANKS)


NORM_UNSHRUNK_WINDOWS_MAX_ROWS = _int_env(
    "MULTILORA_NORM_UNSHRUNK_WINDOWS_MAX_ROWS", "256")
"""The norm computes an unshrunk term by windows for at most this many rows."""


def unshrunk_by_windows(rows: int, max_rank: int, consumer: str, segment_blocks: int) -> bool:
    """Whether ``consumer`` computes an unshrunk term by windows (``unshrunk_by_blocks``):
    SwiGLU wherever the layout allows it; the norm only past the by-rows budget and up to
    ``NORM_UNSHRUNK_WINDOWS_MAX_ROWS`` rows. Down's shrink runs over 14,336 columns and a
    window repeats it once a column group. H200, 4 layers, 16 adapters, the norm's kernel
    time a forward: r=16 bs 256 233 us by rows, 335 by windows; r=64 bs 256 499 by windows
    (the pending term by windows: 187, plus the projections' shrink launches), eager LoRA
    over base 1.52-1.60x against 1.74-1.78x with the shrinks launched (host-bound); prefill
    4 x 256 r=16 706 us by windows against 219 pending by windows (kernel-bound there)."""
    return unshrunk_by_blocks(rows, consumer, segment_blocks) and (consumer != "norm" or (
        not unshrunk_by_rows(rows, max_rank) and rows <= NORM_UNSHRUNK_WINDOWS_MAX_ROWS))


def shrink_in_consumer(x: torch.Tensor, max_rank: int, consumer: str,
                       segment_blocks: int) -> bool:
    """Eager (no capture, no tracer: a graph must read its static layout), within the rank
    limit, and within the rows limit of ``consumer``'s program shape: by windows
    (``unshrunk_by_windows``, ``CONSUMER_SHRINK_BLOCKS_MAX_ROWS``) or by rows
    (``unshrunk_by_rows``)."""
    rows = x.shape[0]
    if max_rank > CONSUMER_SHRINK_MAX_RANK:
        return False
    if unshrunk_by_windows(rows, max_rank, consumer, segment_blocks):
        within = rows <= CONSUMER_SHRINK_BLOCKS_MAX_ROWS
    else:
        within = unshrunk_by_rows(rows, max_rank)
    return within and eager(x)


def row_block_n(block_r: int) -> int:
    """Columns of a by-rows epilogue program: its B tile (columns x rank block) stays at 4096
    elements per slice."""
    return max(32, 4096 // block_r)


PENDING_WINDOWS_MIN_ROWS = {
    "norm": _int_env("MULTILORA_NORM_PENDING_WINDOWS_MIN_ROWS", "128"),
    "rope": _int_env("MULTILORA_ROPE_PENDING_WINDOWS_MIN_ROWS", "128"),
}
"""Eager forwards of this many rows or more whose projection leaves its expand to the
consumer have it add the pending term by windows of ``FUSE_BLOCK_M`` permuted rows instead of
by rows: B is read once a window and column tile, not once a row. The norm (o_proj's and
down's term, ``kernels.rms_norm_windows``) only within ``pending_by_rows``'s eager budget.
H200, 4 layers, 16 adapters r=64, bs 256: the norm's kernel time a forward 697 us by rows,
182-187 by windows. Read at import; a huge value: never."""

GRAPH_WINDOWS_MIN_ROWS = {
    "rope": _int_env("MULTILORA_ROPE_GRAPH_WINDOWS_MIN_ROWS", "128"),
    "norm": _int_env("MULTILORA_NORM_GRAPH_WINDOWS_MIN_ROWS", str(sys.maxsize)),
}
"""The same inside a graph capture or a trace, where the alternative is the projection's
separate expand after its GEMM: RoPE (qkv's term, ``kernels.rope_kv_windows``), the norm
(o_proj's and down's, ``kernels.rms_norm_windows``: off by default). A window of many distinct slots
walks them in sequence, so few rows a slot favour the expand's grid: H200, LoRA replay minus
base replay (us, two rounds, expand / by windows), 4 layers 16 adapters r=16 bs 64 138 / 144,
bs 128 197-204 / 186-204, bs 256 159-187 / 169-177; 4 adapters bs 64 75-80 / 70-72, bs 256
112-131 / 102; prefill 256 tokens 140-142 / 122-126; full depth 8 adapters bs 64 772 / 749,
bs 256 1261-1405 / 1226-1283."""


def pending_by_windows(x: torch.Tensor, consumer: str) -> bool:
    """Whether ``consumer`` adds a pending term to ``x``'s rows by windows. The rows are
    checked first: ``eager`` costs host time, and a decode step asks this every layer."""
    rows = x.shape[0]
    at_eager = PENDING_WINDOWS_MIN_ROWS.get(consumer, sys.maxsize)
    in_graph = GRAPH_WINDOWS_MIN_ROWS.get(consumer, sys.maxsize)
    if rows < min(at_eager, in_graph):
        return False
    return rows >= (at_eager if eager(x) else in_graph)


def expand_in_consumer(x: torch.Tensor, consumer: str, max_rank: int, num_slots: int = 0
                       ) -> bool:
    """Whether a projection of ``x``'s rows leaves its expand to ``consumer`` ("rope" for qkv,
    "silu_mul" for gate_up, "norm" for o_proj and down). Callers check the eager one-launch
    route first (host-bound: one launch beats a shrink whose term a consumer adds)."""
    return pending_by_rows(x, consumer, max_rank, num_slots) or (
        consumer == "silu_mul" and fused_expand(x.shape[0])) or (
        consumer in ("rope", "norm") and pending_by_windows(x, consumer)
        # eager: the norm by windows only within pending_by_rows's budget (above)
        and (consumer == "rope" or not eager(x)))


DELTA_MAX_ROWS = {
    "norm": _int_env("MULTILORA_NORM_DELTA_MAX_ROWS", "2"),
    "down": _int_env("MULTILORA_DOWN_DELTA_MAX_ROWS", "2"),
    "rope": _int_env("MULTILORA_ROPE_DELTA_MAX_ROWS", "2"),
    "silu_mul": _int_env("MULTILORA_SILU_DELTA_MAX_ROWS", "2"),
}
"""Inside a CUDA graph capture, forwards of at most this many rows compute their LoRA term beside
the base GEMM into a float32 delta that the next kernel adds (read at import; -1: never): the
residual add + RMSNorm after o_proj ("norm") and after down ("down"), RoPE with the KV write
after qkv ("rope"), SwiGLU's activation after gate_up ("silu_mul"). The expand then leaves the
critical path after the GEMM. H200, full depth 8 adapters, LoRA decode replay minus base (us),
all three off (by-rows consumers, separate o/down expands) / on: bs 1 446 / 185-190, bs 2 415
(norm only at 1 row) / 293-298, bs 4 498 / 525, bs 8 658 / 860. From four rows the side branch
(shrink, then expand) outlasts the GEMM beside it (docs/perf-notes.md)."""


def delta_beside(x: torch.Tensor, route: str) -> bool:
    return (x.shape[0] <= DELTA_MAX_ROWS[route] and x.device.type == "cuda"
            and torch.cuda.is_current_stream_capturing())


ONE_LAUNCH_MAX_ROWS = _int_env("MULTILORA_ONE_LAUNCH_MAX_ROWS", "64")
"""Eager LoRA linears of at most this many rows may run shrink and expand as one launch
(``kernels.shrink_expand``; read at import, 0: never). Each output group recomputes its
block's shrink, so the GPU work grows with blocks x groups: only worth it where an eager step
is bound by its launches' host time. Above ``ONE_LAUNCH_FREE_ROWS`` rows the recomputation is
bounded by ``ONE_LAUNCH_BUDGET``."""

ONE_LAUNCH_FREE_ROWS = 16

ONE_LAUNCH_BUDGET = _int_env("MULTILORA_ONE_LAUNCH_BUDGET", "2048")
"""Above ``ONE_LAUNCH_FREE_ROWS`` rows, one launch only while ``blocks x (block_m + rank
block)`` (the rows of x and A each output group re-reads) is at most this. H200, 4 layers,
eager LoRA step over eager base at 16 / 64 rows' limit: 16 adapters r=16, bs 64 (16 x 32 =
512) 2.25 / 1.72x; 16 adapters r=64 (1280) 2.18 / 1.77x; 64 adapters r=16 (2048) 2.26 /
2.18x; 64 adapters r=64 (5120) 2.24 / 3.00x (bound by the recomputation on the GPU)."""


def one_launch_lora(x: torch.Tensor, blocks: int, block_m: int, max_rank: int) -> bool:
    """Eager (neither a CUDA graph capture nor a tracer: both keep the two-launch schedule, the
    shrink beside the GEMM), few rows, and a bounded recomputation of the shrink
    (``blocks``: the layout's segment blocks of ``block_m`` rows)."""
    rows = x.shape[0]
    if rows > ONE_LAUNCH_MAX_ROWS or (
            rows > ONE_LAUNCH_FREE_ROWS
            and blocks * (block_m + rank_block(max_rank)) > ONE_LAUNCH_BUDGET):
        return False
    return eager(x)


FORK_MAX_ROWS = _int_env("MULTILORA_FORK_MAX_ROWS", "2048")
"""Inside a CUDA graph capture, forwards of at most this many rows run each shrink on a branch
beside its base GEMM (``lora_runtime.lora.side_stream``); larger ones run it after the GEMM,
in stream order: their GEMMs fill the device, and a branch beside them only takes SMs from
them. H200, 4 layers, 16 adapters r=16, prompts of 256 tokens, LoRA prefill replay minus
base (us, median of 12 interleaved rounds), beside / in order: 1,024 tokens 439 / 456, 2,048
tokens 567 / 492, 4,096 tokens 1,388 / 877 (an earlier run at 1,024 tokens: 152 / 452; at
2,048 the rounds overlap, and the kernel suite's modules favoured the branch there)."""

def _int_pair(env: str, default: str) -> tuple[int, int]:
    text = os.environ.get(env, default)
    try:
        first, second = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{env}={text!r}: give two integers separated by a comma, e.g. "
                         f"{env}={default}") from None
    return first, second


CAPTURE_GEMM_LT_ROWS = _int_pair("MULTILORA_CAPTURE_GEMM_LT_ROWS", "33,64")
"""``(lo, hi)``: a CUDA graph captured for lo..hi rows runs every GEMM through cuBLASLt
instead of cuBLAS's default choice (``lora_runtime.model.gemm_library``; read at import,
"0,0": never). Captures only: eager forwards keep the default. 8 layers of Llama-3-8B shapes,
8 adapters r=16, context 512, decode replays LoRA / base traffic, us, cuBLAS / cuBLASLt: H100
bs 1 1882 / 1869 and 1845 / 1842, bs 16 2116 / 2109 and 1987 / 1985, bs 64 2452 / 2402 and
2260 / 2243, bs 256 4115 / 4147 and 3772 / 3772; H200 base bs 1 1359 / 1348, bs 16 1464 /
1479, bs 64 1704 / 1652, bs 256 3307 / 3477 (docs/perf-notes.md, sessions 44 and 50)."""

DELTA_GEMM_SMS_FREE = _int_pair("MULTILORA_DELTA_GEMM_SMS_FREE", "3,0")
"""``(min_rows, sms)``: a captured base GEMM of at least min_rows rows whose LoRA term runs
beside it (the delta route, ``DELTA_MAX_ROWS``) goes through cuBLASLt told to leave ``sms``
SMs free, so the branch's kernels start at once instead of waiting for the GEMM's blocks to
retire (read at import; sms 0: off)."""

PDL = os.environ.get("MULTILORA_PDL", "1") != "0"
"""``MULTILORA_PDL=0`` (read at import) turns programmatic dependent launch off (A/B runs)."""


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the expand: Hopper or newer, a Triton with grid
    dependency control, and only while a CUDA graph is being captured (eager launches gain
    nothing from it and stay as they were)."""
    return (PDL and device.type == "cuda" and not interpreted() and _pdl_capable(device.index)
            and torch.cuda.is_current_stream_capturing())


@functools.cache
def _pdl_capable(device_index: int | None) -> bool:
    import triton.language as tl

    index = device_index if device_index is not None else torch.cuda.current_device()
    gdc = getattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait", None)
    return gdc is not None and torch.cuda.get_device_capability(index)[0] >= 9


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise run through tf32 on the GPU (~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"
