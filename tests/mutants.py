"""Fault injection: apply, one at a time, faults that each break one protection against stale
LoRA metadata, and run the stale-state tests against each. Every fault must be caught.

    nox -s mutants            # or: python tests/mutants.py [--only NAME] [--list]

A fault counts as killed when the tests fail (pytest exit 1); a copy of the tree is mutated,
never the checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_batch_state.py",
    "tests/test_graph_replay.py",
    "tests/test_graph_schedules.py::test_every_replay_matches_eager[torch]",
    "tests/test_graph_schedules.py::test_every_replay_matches_eager[triton]",
]
BLOCK_TESTS = ("tests/test_graph_blocks.py", "tests/test_slot_reuse.py",
               "tests/test_prefill_prefix_graphs.py")
DP_TESTS = ("tests/test_dp.py::test_dp_logits_equal_the_dp1_reference[2-skewed-False-False]",
            "tests/test_dp.py::test_dp_logits_equal_the_dp1_reference[2-least_loaded-True-True]")


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...] = ()
    """The tests that must catch it (default: ``TESTS``)."""


MUTANTS = [
    Mutant("idle_skips_reset", "building an idle batch no longer resets the LoRA batch",
           "lora_runtime/engine/forward_batch.py",
           (("        if lora_manager is not None:\n            lora_manager.reset_lora_batch()",
             "        if False:\n            lora_manager.reset_lora_batch()"),)),
    Mutant("gate_on_set_lora", "layers gate on set_lora instead of lora_active",
           "lora_runtime/lora/layers.py",
           (("return self.set_lora and self.backend.layout_ready(self.rows)",
             "return self.set_lora"),)),
    Mutant("reset_forgets_lm_head_pass", "reset clears batch_info but not the derived lm_head pass",
           "lora_runtime/lora/backends/base.py",
           (("        self.batch_info = None\n        self.logits_info = None\n",
             "        self.batch_info = None\n"),)),
    Mutant("runner_reallocates_metadata",
           "static LoRA metadata is reallocated per replay instead of copied into",
           "kernels/segments.py",
           (("        self._buf.copy_(self._staging, non_blocking=True)",
             "        self._buf = self._staging.to(self._buf.device, copy=True)"),)),
    Mutant("grid_from_batch_block_count",
           "the shrink grid is sized by the batch's live block count (a per-batch Python int)",
           "kernels/shrink.py",
           (("    block_k, splits, k_per_split, num_warps = _launch_shape(\n",
             "    live = int((layout.block_ends > layout.block_starts).sum())\n"
             "    layout = type(layout)(layout.token_slots, layout.permutation,\n"
             "                          layout.block_slots[:live], layout.block_starts[:live],\n"
             "                          layout.block_ends[:live], layout.block_m)\n"
             "    block_k, splits, k_per_split, num_warps = _launch_shape(\n"),)),
    Mutant("block_m_from_segment_length",
           "the block size follows the batch's longest request (a per-batch Python int)",
           "lora_runtime/lora/manager.py",
           (("rows = SegmentSpec(tuple(slots), tuple(batch.extend_lens), EXTEND_BLOCK_M, skip)",
             "rows = SegmentSpec(tuple(slots), tuple(batch.extend_lens),\n"
             "                               max(16, 1 << (max(batch.extend_lens) - 1)"
             ".bit_length()), skip)"),)),
    Mutant("idle_keeps_previous_slots",
           "an idle replay keeps the previous batch's slots in the static buffers",
           "lora_runtime/lora/manager.py",
           (("            plan = None if batch is None else self.plan_lora_batch(batch)",
             "            if batch is None:\n                return\n"
             "            plan = self.plan_lora_batch(batch)"),)),
    Mutant("base_graph_by_first_request",
           "the no-LoRA graph is chosen when the first request has no adapter",
           "graphs/runner.py",
           (("(idle and self.dp is not None) or batch.has_adapters)",
             "(idle and self.dp is not None) or batch.adapter_names[:1] != (None,))"),
            )),
    Mutant("metadata_cached_by_adapter_names",
           "replay skips the metadata refresh when the batch names the same adapters",
           "lora_runtime/lora/manager.py",
           (("            plan = None if batch is None else self.plan_lora_batch(batch)",
             "            key = None if batch is None else batch.adapter_names\n"
             "            if key is not None and key == getattr(self, '_last_key', None):\n"
             "                return\n"
             "            self._last_key = key\n"
             "            plan = None if batch is None else self.plan_lora_batch(batch)"),)),
    Mutant("padding_rows_keep_cache_slots",
           "decode padding rows keep the previous batch's KV-cache slots",
           "graphs/static_batch.py",
           (("        _put(self.out_cache_loc, b and b.out_cache_loc, n, bucket, KVCache.SCRATCH)",
             "        _put(self.out_cache_loc, b and b.out_cache_loc, n, n, KVCache.SCRATCH)"),)),
    Mutant("decode_write_pads_keep_cache_slots",
           "the one-launch decode write (GPU graphs) leaves padding rows' KV-cache slots as "
           "they were",
           "kernels/decode_inputs.py",
           (("    tl.store(loc_dst + row, tl.where(live, tl.load(loc_src + src), SCRATCH))",
             "    tl.store(loc_dst + row, tl.load(loc_src + src), mask=live)"),),
           ("tests/test_decode_inputs.py",)),
    Mutant("decode_write_keeps_stale_table_tail",
           "the one-launch decode write copies a row's KV slots but leaves the previous "
           "batch's entries past its width",
           "kernels/decode_inputs.py",
           (("        tl.store(dst_row + cols, v, mask=inside)",
             "        tl.store(dst_row + cols, v, mask=inside & (cols < copied))"),),
           ("tests/test_decode_inputs.py",)),
    Mutant("slot_reuse_keeps_old_ranks",
           "an adapter written into an evicted slot keeps the evicted adapter's ranks",
           "lora_runtime/lora/slot_image.py",
           (("        torch._foreach_copy_(rank_dst, self._table_sources[0])\n",
             "        for d, r in zip(rank_dst, self._table_sources[0]):\n"
             "            d.copy_(torch.where(d == 0, r, d))\n"),)),
    Mutant("slot_regions_cached_across_slots",
           "the slot writer's cached destination views ignore the slot (writes land in the "
           "first slot written)",
           "lora_runtime/lora/slot_image.py",
           (("            dst = [regions.get((slot, b)) for b in image.blocks]",
             "            dst = [regions.get((-1, b)) for b in image.blocks]"),
            ("                    dst[i] = regions[(slot, image.blocks[i])] = ",
             "                    dst[i] = regions[(-1, image.blocks[i])] = ")),
           ("tests/test_slot_image.py", "tests/test_slot_reuse.py")),
    Mutant("slot_write_skips_zeroing",
           "a slot write leaves the evicted adapter's weights past the new adapter's ranks",
           "lora_runtime/lora/slot_image.py",
           (("        torch._foreach_zero_(zero)\n", ""),), ("tests/test_slot_image.py",)),
    Mutant("runners_share_lora_buffers",
           "graph runners share one set of static LoRA buffers",
           "lora_runtime/lora/backends/base.py",
           (("        return LoRAGraphBuffers(\n",
             "        if getattr(self, '_shared', None) is not None:\n"
             "            return self._shared\n"
             "        self._shared = LoRAGraphBuffers(\n"),
            ("            layout(dp_size * max_rows, block_m) if dp_size > 1 else None,\n"
             "        )\n",
             "            layout(dp_size * max_rows, block_m) if dp_size > 1 else None,\n"
             "        )\n        return self._shared\n"))),
    Mutant("view_offsets_from_bucket_table",
           "a bucket's view of the block tables starts at offsets of its own table size",
           "kernels/segments.py",
           (("offsets += [offsets[2] + k * self.blocks_for(self.max_rows) for k in (1, 2)]",
             "offsets += [offsets[2] + k * nb for k in (1, 2)]"),), BLOCK_TESTS),
    Mutant("slot_reuse_keeps_old_scalings",
           "an adapter written into an evicted slot keeps the evicted adapter's scalings",
           "lora_runtime/lora/slot_image.py",
           (("        torch._foreach_copy_(scal_dst, self._table_sources[1])\n",
             "        for d, c in zip(scal_dst, self._table_sources[1]):\n"
             "            d.copy_(torch.where(d == 0, c, d))\n"),),
           BLOCK_TESTS),
    Mutant("idle_rank_keeps_local_metadata",
           "DP: a rank without local adapters (an idle one) keeps the previous local metadata",
           "lora_runtime/lora/backends/base.py",
           (("        self._set(None if rows is None else LoRABatchInfo(rows), logits, gathered)\n",
             "        self._set(self.batch_info if rows is None else LoRABatchInfo(rows),\n"
             "                  self.logits_info if logits is None else logits, gathered)\n"),),
           DP_TESTS),
    Mutant("gathered_layers_read_local_metadata",
           "DP: the MLP's LoRA reads the rank-local layout instead of the gathered one",
           "lora_runtime/lora/backends/base.py",
           (("        self.gathered_info = gathered if gathered is not None else (",
             "        self.gathered_info = None if info is None else info.rows\n"
             "        _ = gathered if gathered is not None else ("),), DP_TESTS),
    Mutant("variant_chosen_rank_locally",
           "DP: each rank picks the graph variant from its own requests' adapters",
           "lora_runtime/dp/dp_engine.py",
           (("        return ag.bucket if ag.use_graph else None, ag.lora",
             "        return ag.bucket if ag.use_graph else None, bool("
             "self.scheduler.running_adapters())"),), DP_TESTS),
    Mutant("bucket_chosen_rank_locally",
           "DP: each rank replays the bucket its own batch fits (must raise, not hang)",
           "lora_runtime/dp/dp_engine.py",
           (("        return ag.bucket if ag.use_graph else None, ag.lora",
             "        own = ag.ranks[self.dp.rank].bucket\n"
             "        return (max(own, 1) if ag.use_graph else None), ag.lora"),), DP_TESTS),
    Mutant("row_parallel_lora_counted_per_rank",
           "DP: the row-parallel down_proj LoRA term is counted once per rank by the reduce",
           "lora_runtime/lora/manager.py",
           (("            return m.a[:, self.dp.rank * k : (self.dp.rank + 1) * k], m.b",
             "            return m.a[:, self.dp.rank * k : (self.dp.rank + 1) * k], "
             "m.b * self.dp.size"),), DP_TESTS),
    Mutant("peers_variant_runs_local_lora",
           "DP: the peers variant (a rank without adapters of its own) also runs LoRA on the "
           "rank's own rows",
           "graphs/runner.py",
           (("        local = kind == LORA", "        local = kind != BASE"),), DP_TESTS),
    Mutant("launcher_checks_ignore_the_input",
           "the weights-only launcher checks, once passed, are skipped for any later input",
           "kernels/shrink.py",
           (("    if seen is not None and seen[0] is a"
             " and seen[1:] == (x.dtype, x.device, x.shape[1]):",
             "    if seen is not None:"),),
           ("tests/test_kernel_checks.py",)),
    Mutant("one_launch_ignores_its_budget",
           "the eager one-launch route skips the bound on its recomputed shrinks",
           "lora_runtime/lora/backends/triton_backend.py",
           (("                x, layout.block_slots.shape[0], layout.block_m, weights.max_rank)",
             "                x, 0, layout.block_m, 0)"),),
           ("tests/test_linear_schedule.py",)),
    Mutant("consumer_shrink_reads_slice_zero",
           "a consumer that computes the shrink itself reads every slice's A rows from slice 0",
           "kernels/row_lora.py",
           (("        a_slot = la_ptr + slot.to(tl.int64) * stride_as + sl * max_rank * stride_ar",
             "        a_slot = la_ptr + slot.to(tl.int64) * stride_as"),),
           ("tests/test_fused_expand.py::test_rope_with_the_qkv_term_matches_expand_then_rope"
            "[torch.float32-unshrunk]",)),
    Mutant("consumer_shrink_reads_past_k",
           "a consumer's shrink loads a step's x and A columns past K (the last partial step)",
           "kernels/row_lora.py",
           (("                k_mask = offs_k < K\n",
             "                k_mask = offs_k < K + 16\n"),),
           ("tests/test_fused_expand.py::test_norm_with_a_term_matches_expand_then_norm"
            "[torch.float32-unshrunk]",)),
    Mutant("eager_layouts_reused_for_any_batch",
           "an eager batch reuses the layouts of any kept batch of the same block size",
           "lora_runtime/lora/backends/base.py",
           (("        key = (plan.rows_spec, plan.logits_spec, plan.gathered_spec)",
             "        key = (plan.rows_spec.block_m,)"),),
           ("tests/test_layout_refresh.py",)),
    Mutant("window_shrink_mixes_slots",
           "a window's shrink gives a row the product with another slot's A as well",
           "kernels/lora_epilogue.py",
           (("m_mask & (slots == cur), cur,", "m_mask & (slots >= cur), cur,"),),
           ("tests/test_fused_expand.py::"
            "test_unshrunk_blocks_keep_each_slots_shrink_to_its_own_rows",)),
    Mutant("window_route_ignores_adapters_per_window",
           "SwiGLU takes an unshrunk term by windows however many adapters a window holds",
           "kernels/config.py",
           (("            and segment_blocks <= cdiv(rows, 16))", "            )"),),
           ("tests/test_linear_schedule.py::"
            "test_swiglu_and_the_norm_take_the_unshrunk_term_by_windows_of_about_one_adapter",)),
    # (The first program of a window normalising it is a race only a GPU shows: in the
    # interpreter programs run in turn, and its counter reset makes every later one redo it.)
    Mutant("norm_window_misses_a_partial_sum",
           "the last program of a window sums one column group's squares too few",
           "kernels/rms_norm_windows.py",
           (("        for g in range(GROUPS):", "        for g in range(GROUPS - 1):"),),
           ("tests/test_fused_expand.py::test_norm_with_a_term_matches_expand_then_norm"
            "[torch.float32-windows]",)),
    Mutant("norm_window_counter_left_set",
           "the last program of a window leaves its counter set: the next launch misreads it",
           "kernels/rms_norm_windows.py",
           (("        tl.store(count_ptr + win, 0)", "        pass"),),
           ("tests/test_fused_expand.py::test_norm_with_a_term_matches_expand_then_norm"
            "[torch.float32-windows]",)),
    Mutant("norm_split_misses_a_partial_sum",
           "the last program of a split row sums one column group's squares too few",
           "kernels/rms_norm_split.py",
           (("mask=g < GROUPS, other=0.0,", "mask=g < GROUPS - 1, other=0.0,"),),
           ("tests/test_fused_expand.py::test_norm_with_a_term_matches_expand_then_norm"
            "[torch.float32-split]",)),
    Mutant("rope_window_v_takes_k_slice",
           "RoPE by windows adds k's slice of the term to v",
           "kernels/rope_kv_windows.py",
           (("a_v, rank_v, scale_v = _row_slice(*per_row, 2,",
             "a_v, rank_v, scale_v = _row_slice(*per_row, 1,"),),
           ("tests/test_fused_expand.py::test_rope_with_the_qkv_term_matches_expand_then_rope"
            "[torch.float32-windows]",)),
    Mutant("column_align_claims_16",
           "the expand promises the compiler 16-column slice bounds whatever the widths (on a "
           "GPU its masks would cover columns of the next slice)",
           "kernels/weights.py",
           (("        return min(16, g & -g)", "        return 16"),),
           ("tests/test_kernel_checks.py::test_column_align_divides_every_slice_bound",)),
    Mutant("expand_hint_dropped",
           "the expand no longer tells the compiler its slice bounds' alignment (y's accesses "
           "compile to 2-byte loads and stores: half the prefill bandwidth)",
           "kernels/expand.py",
           (("    return sl, tl.multiple_of(n_lo, COL_ALIGN), tl.multiple_of(n_hi, COL_ALIGN)",
             "    return sl, n_lo, n_hi"),),
           ("tests/test_gpu_compile.py::test_the_expand_stores_y_in_16_byte_vectors",)),
    Mutant("b_masked_by_slot_rank",
           "the expand masks B by the slot's rank again (known only at run time: B loaded "
           "2 bytes at a time)",
           "kernels/expand.py",
           (("    b_r_mask = offs_r < max_rank", "    b_r_mask = r_mask"),),
           ("tests/test_gpu_compile.py::test_b_loads_are_16_byte_vectors_where_max_rank_allows",)),
    Mutant("pool_rule_dropped",
           "RoPE and SwiGLU no longer take the term by rows when the pool has a slot a row "
           "(64 adapters at bs 64: 30.2% over the base replay becomes 37.0%)",
           "kernels/config.py",
           (("        consumer != \"norm\" and rows <= min(num_slots, POOL_EPILOGUE_MAX_ROWS))",
             "        False)"),),
           ("tests/test_linear_schedule.py::test_a_pool_with_a_slot_a_row_takes_the_term_by_rows",)),
    Mutant("warm_up_past_positions",
           "the warm-up's requests ignore the model's rotary table (one request takes a "
           "whole step's tokens)",
           "lora_runtime/engine/warm_up.py",
           (("    cap = max_positions or kv_tokens", "    cap = kv_tokens"),),
           ("tests/test_engine_limits.py::test_a_request_past_the_models_positions_is_refused",
            "tests/test_warm_up.py::test_phases_fit_the_engine_and_span_its_limits")),
    Mutant("plan_reused_across_slot_changes",
           "a batch of the last batch's adapter names reuses its plan even after a slot "
           "changed hands (a reloaded adapter is never moved into a slot)",
           "lora_runtime/lora/manager.py",
           (("last[:2] == (key, self.pool.version)", "last[0] == key"),),
           ("tests/test_batch_state.py::"
            "test_a_repeated_batch_reuses_its_plan_until_a_slot_changes",)),
    Mutant("reused_plan_skips_lru",
           "a reused plan does not touch its adapters: the LRU pool evicts one in steady use",
           "lora_runtime/lora/manager.py",
           (("            self.pool.touch(last[2])\n", ""),),
           ("tests/test_batch_state.py::"
            "test_a_repeated_batch_reuses_its_plan_until_a_slot_changes",)),
    Mutant("ahead_step_stale_tokens",
           "a decode step run ahead (overlap) feeds placeholders, not the previous step's "
           "tokens still on the device",
           "lora_runtime/engine/requests.py",
           (("        ids = pending.to(device=pos.device, dtype=torch.int64)\n",
             "        ids = torch.zeros_like(pos)\n"),),
           ("tests/test_engine_overlap.py::"
            "test_overlap_serves_the_same_tokens_and_frees_the_cache",)),
    Mutant("ahead_step_mixed_rows_stale",
           "a decode run ahead whose requests' last tokens are partly on the host (a prefill "
           "in flight sampled the others) feeds placeholders for the pending ones",
           "lora_runtime/engine/requests.py",
           (("ids = torch.where(from_rows >= 0, taken, known)", "ids = known"),),
           ("tests/test_engine_overlap.py::"
            "test_overlap_serves_the_same_tokens_and_frees_the_cache",)),
    Mutant("sampled_judged_at_take",
           "whether a request samples is judged when its tokens are read, after a step run "
           "ahead cached the rest of its prompt: a mid-prompt row becomes its first token",
           "lora_runtime/engine/engine.py",
           (("            if not sampled:  # a chunk",
             "            if req.prefilling:  # a chunk"),),
           ("tests/test_engine_overlap.py::"
            "test_overlap_serves_the_same_tokens_and_frees_the_cache",
            "tests/test_engine.py::test_engine_matches_requests_run_alone")),
    Mutant("compiles_counted_twice_ahead",
           "a compile while launching the step run ahead is counted by the step in flight too",
           "lora_runtime/engine/engine.py",
           (("            ahead_of.jit_end = self._jit_at_start", "            pass"),),
           ("tests/test_engine_overlap.py::"
            "test_each_compile_is_counted_once_by_the_step_that_caused_it",)),
    Mutant("generate_queues_before_checking",
           "generate() queues its prompts one by one: a refused one leaves the earlier queued",
           "lora_runtime/engine/engine.py",
           (("                reqs.append(self._checked(p, a, max_new_tokens, ()))\n",
             "                reqs.append(self.add_request(p, a, "
             "max_new_tokens=max_new_tokens))\n"),
            ("        return [self._queue(r) for r in reqs]\n", "        return reqs\n")),
           ("tests/test_engine_limits.py::test_generate_refuses_all_its_prompts_or_none",)),
    Mutant("dp_rank_runs_ahead_alone",
           "a DP rank decides alone whether to run ahead: its step() returns one agreement "
           "later than another rank's, whose next control collective pairs with it",
           "lora_runtime/dp/dp_engine.py",
           (("        if self._agreed.run_ahead:", "        if self._may_run_ahead(cur):"),),
           ("tests/test_dp_control.py::"
            "test_ranks_run_ahead_together_so_control_calls_pair_up",)),
    Mutant("dp_run_ahead_ignores_pending_tokens",
           "a DP rank judges run-ahead before the step in flight's tokens are read without "
           "counting them: a step runs ahead past a request's last token",
           "lora_runtime/engine/engine.py",
           (("    return any(len(r.output) + (r in pending) + 1 >= r.max_new_tokens",
             "    return any(len(r.output) + 1 >= r.max_new_tokens"),),
           ("tests/test_dp_control.py::"
            "test_ranks_run_ahead_together_so_control_calls_pair_up",)),
    Mutant("step_records_graph_at_finish",
           "a step's graph variant and bucket read when it is recorded, after a step launched "
           "ahead replayed the same runner",
           "lora_runtime/engine/engine.py",
           (("        self._record(cur.plan, cur.graph, cur.start,",
             "        self._record(cur.plan, _replayed_as(cur.replayed), cur.start,"),),
           ("tests/test_engine_overlap.py::test_each_step_records_the_graph_it_replayed",)),
    Mutant("failed_slot_write_keeps_owner",
           "a slot write that fails after zeroing the slot leaves the table naming its old "
           "adapter: a later batch serves the half-written slot",
           "lora_runtime/lora/manager.py",
           (("            self.pool.release(old)", "            pass"),),
           ("tests/test_faults.py::test_a_failed_slot_write_never_serves_the_half_written_slot",)),
    Mutant("failed_step_keeps_kv_slots",
           "a step whose forward raised keeps the KV slots its build took, as cached tokens "
           "whose K/V was never written",
           "lora_runtime/engine/engine.py",
           (("                if len(r.kv_slots) > n:", "                if False:"),),
           ("tests/test_faults.py::test_a_step_that_raises_leaves_the_engine_serving_correctly",)),
    Mutant("floor_counts_rows",
           "LoRA's bytes floor counts an adapter once per row that uses it, not once a step",
           "bench/lora_floor.py",
           (("    for n in set(names):\n        if n is None:",
             "    for n in names:\n        if n is None:"),),
           ("tests/test_lora_floor.py::test_a_steps_floor_counts_each_distinct_adapter_once",)),
    Mutant("dp_ahead_reads_no_pending_tokens",
           "a DP rank's step run ahead is built as if the step in flight had been read (its "
           "requests' last tokens taken from the host)",
           "lora_runtime/dp/dp_engine.py",
           (("batch = None if plan is None else self._build(plan, running)",
             "batch = None if plan is None else self._build(plan)"),),
           ("tests/test_dp.py::test_dp_logits_equal_the_dp1_reference",)),
    Mutant("fork_any_rows",
           "every captured forward forks the shrink beside its GEMM, prefills that fill the "
           "device too",
           "lora_runtime/lora/side_stream.py",
           (("x.shape[0] <= config.FORK_MAX_ROWS", "x.shape[0] >= 0"),),
           ("tests/test_linear_schedule.py::"
            "test_a_capture_forks_only_forwards_up_to_the_fork_limit",)),
    Mutant("wide_blocks_for_decode",
           "SwiGLU takes wide blocks for decode layouts too (several slots a block: its slot "
           "loop runs longer)",
           "kernels/config.py",
           (("    return rows >= WIDE_BLOCKS_MIN_ROWS and layout_block_m >= 64",
             "    return rows >= WIDE_BLOCKS_MIN_ROWS"),),
           ("tests/test_fused_expand.py::test_wide_blocks_only_for_extend_layouts",)),
    Mutant("wide_blocks_skip_rows",
           "SwiGLU's wide-block grid counts blocks of twice the rows its programs cover: half "
           "the rows never get their term or activation",
           "kernels/silu_mul.py",
           (("        blocks, tiles = config.cdiv(rows, block_m), config.cdiv(inter, block_n)",
             "        blocks, tiles = config.cdiv(rows, 2 * block_m), "
             "config.cdiv(inter, block_n)"),),
           ("tests/test_fused_expand.py::test_fused_silu_mul_matches_expand_then_activation",)),
    Mutant("one_launch_walks_one_tile",
           "the one-launch kernel's programs walk one output tile each (its shrink recomputed "
           "for every tile)",
           "kernels/config.py",
           (("    while (tiles < ONE_LAUNCH_MAX_TILES and tiles < num_tiles",
             "    while (False and tiles < num_tiles"),),
           ("tests/test_kernel_checks.py::"
            "test_one_launch_programs_walk_the_fewest_tiles_that_fit_one_wave",)),
    Mutant("consumer_route_memoised_under_graph_hooks",
           "the eager route decision is memoised under the graph hooks too (a capture's "
           "eager warm-up would pick the route the capture records)",
           "lora_runtime/lora/backends/base.py",
           (("        self.gathered_info = None\n        self.routes = None\n",
             "        self.gathered_info = None\n        self.routes = {}\n"),),
           ("tests/test_linear_schedule.py::"
            "test_the_consumer_route_is_memoised_only_for_an_eager_prepare",)),
    Mutant("refresh_skipped_for_any_spec",
           "a static layout claims to hold whatever spec it is asked about (refreshes skipped)",
           "kernels/segments.py",
           (("        return (held is not None and held[0] == spec and held[1] <= rows",
             "        return (held is not None and held[1] <= rows"),),
           (*TESTS, "tests/test_layout_refresh.py")),
    Mutant("direct_write_keeps_held_spec",
           "a write that names no spec (a capture, an idle refresh) keeps the spec held before",
           "kernels/segments.py",
           (("        self._held = None if spec is None or plan is None else (",
             "        self._held = self._held if spec is None or plan is None else ("),),
           (*TESTS, "tests/test_layout_refresh.py")),
    Mutant("dp_ids_in_load_order",
           "DP: the agreement numbers adapters in each rank's load order",
           "lora_runtime/dp/dp_engine.py",
           (("        return sorted(self.lora.adapters) if self.lora is not None else []",
             "        return list(self.lora.adapters) if self.lora is not None else []"),),
           ("tests/test_dp_control.py::test_loading_order_does_not_change_what_a_request_"
            "computes",)),
    Mutant("dp_pin_checks_own_rank",
           "DP: a pin leaves room for this rank's running adapters only",
           "lora_runtime/dp/dp_engine.py",
           (("        return self._known | self.scheduler.running_adapters()",
             "        return self.scheduler.running_adapters()"),),
           ("tests/test_dp_control.py::test_pin_and_unload_are_refused_on_every_rank",)),
    Mutant("dp_unload_checks_own_rank",
           "DP: an unload is refused only on the rank whose requests use the adapter",
           "lora_runtime/dp/dp_engine.py",
           (("        users = self.host.ranks_with(mine, \"unload_adapter\")",
             "        users = [self.dp.rank] if mine else []"),),
           ("tests/test_dp_control.py::test_pin_and_unload_are_refused_on_every_rank",)),
    Mutant("dp_digest_names_only",
           "DP: the ranks compare loaded adapters by name only (other weights under one name "
           "are served, wrong on every rank)",
           "lora_runtime/dp/dp_engine.py",
           (("            names, [self.lora.fingerprints[n] for n in names], sorted(",
             "            names, (), sorted("),),
           ("tests/test_dp_control.py::test_one_name_with_other_weights_is_refused_on_every_"
            "rank",)),
    Mutant("dp_digest_without_pins",
           "DP: the ranks' pins are not compared (a pin on one rank fails there alone, mid-step)",
           "lora_runtime/dp/dp_engine.py",
           (("for n in names], sorted(self.lora.pool.pinned))", "for n in names], ())"),),
           ("tests/test_dp_control.py::test_a_pin_on_one_rank_is_refused_on_every_rank_before_"
            "the_forward",)),
    Mutant("overlap_discarded_wait_drops_stream",
           "overlap: an interrupt while the host waits for a step run ahead that serves no one "
           "drops the step just read from step()'s return (its stop token never streamed)",
           "lora_runtime/engine/engine.py",
           (("            self._undelivered += produced\n", "            pass\n"),),
           ("tests/test_engine_faults_stream.py",)),
    Mutant("dp_forward_fault_retried",
           "DP: a rank whose forward raised mid-step steps again: its agreement pairs with a "
           "peer's MLP all-gather (gloo aborts the process)",
           "lora_runtime/dp/dp_engine.py",
           (("            self._fault = f\"{type(e).__name__}: {e}\"\n", ""),
            ("            mark_fault(self.dp, \"a DPEngine's forward raised mid-step\", "
             "self._fault)\n", "")),
           ("tests/test_dp_control.py::test_a_forward_that_raised_on_one_rank_stops_its_later_"
            "calls",)),
    Mutant("dp_starved_rank_ignored",
           "DP: the other ranks keep admitting requests on resident adapters while a rank's "
           "request has waited past max_overtake_steps for a slot (a stream starves it)",
           "lora_runtime/dp/dp_engine.py",
           (("        self.scheduler.admit_adapters = not starved[first] or first == "
             "self.dp.rank\n", ""),),
           ("tests/test_dp_control.py::test_a_request_waiting_for_a_slot_outlasts_no_other_"
            "ranks_stream",)),
    Mutant("dp_refused_generate_leaves_peers",
           "DP: a generate refused on one rank returns at once; the peers' steps pair with its "
           "next call",
           "lora_runtime/dp/dp_engine.py",
           (("            # with them, so every rank's next call pairs up, then raise.\n"
             "            self.run()\n",
             "            # with them, so every rank's next call pairs up, then raise.\n"),),
           ("tests/test_dp_control.py::test_a_call_refused_on_one_rank_leaves_the_ranks_in_"
            "step",)),
    Mutant("dp_host_calls_untagged",
           "DP: host collectives of different calls pair up unchecked",
           "lora_runtime/dp/agreement.py",
           (("        if any(row[0] != tag for row in rows):", "        if False:"),),
           ("tests/test_dp_control.py::test_a_call_refused_on_one_rank_leaves_the_ranks_in_"
            "step",)),
    Mutant("dp_ahead_error_drops_step_in_flight",
           "DP: an agreement that raises while launching ahead loses the step in flight",
           "lora_runtime/engine/engine.py",
           (("            self._undelivered += self._finish(cur)\n            raise\n",
             "            raise\n"),),
           ("tests/test_dp_control.py::test_one_name_with_other_weights_is_refused_on_every_"
            "rank",)),
    Mutant("ahead_error_tokens_unstreamed",
           "a step launched ahead that raises: the step in flight's tokens reach the requests "
           "but no step() returns them",
           "lora_runtime/engine/engine.py",
           (("            self._undelivered += self._finish(cur)\n",
             "            self._finish(cur)\n"),),
           ("tests/test_overlap_fault_stream.py",)),
    Mutant("interrupted_token_read_dropped",
           "overlap: an interrupt while the host waits for a step's tokens loses the step",
           "lora_runtime/engine/engine.py",
           (("            self._unread = cur\n            raise\n", "            raise\n"),),
           ("tests/test_interrupt_at_token_read.py",)),
    Mutant("token_read_outside_undo",
           "serial: an interrupt while the host reads a step's tokens keeps its KV slots "
           "without its tokens",
           "lora_runtime/engine/engine.py",
           (("            tokens = self._sample(plan, logits)\n        produced",
             "        tokens = self._sample(plan, logits)\n        produced"),),
           ("tests/test_interrupt_at_token_read.py",)),
    Mutant("dp_stuck_idles_forever",
           "DP: a request no rank can ever admit leaves every rank stepping idle",
           "lora_runtime/dp/dp_engine.py",
           (("        if self._idle_with_work <= 2 * self.dp.size:",
             "        if True:"),),
           ("tests/test_dp_control.py::test_a_request_that_can_never_be_admitted_raises_on_"
            "every_rank",)),
    Mutant("fractional_token_budget",
           "a request takes a fractional max_new_tokens (its KV budget over-commits the cache)",
           "lora_runtime/engine/requests.py",
           (("    if not is_int(value) or value < 1:\n"
             "        raise ValueError(f\"{call}max_new_tokens",
             "    if value < 1:\n        raise ValueError(f\"{call}max_new_tokens"),),
           ("tests/test_engine_limits.py::test_bad_requests_are_refused_and_the_others_served",)),
    Mutant("failed_warm_up_keeps_requests",
           "a warm-up that fails leaves its requests queued, served before the user's",
           "lora_runtime/engine/warm_up.py",
           (("        engine._discard_all()  # a failed warm-up leaves no request behind either",
             "        pass"),),
           ("tests/test_warm_up.py::test_a_failed_warm_up_leaves_nothing_behind",)),
    Mutant("adapter_range_checked_before_cast",
           "an adapter finite in its own dtype but not in the model's is accepted",
           "lora_runtime/lora/manager.py",
           (("        _check_representable(adapter, self.dtype)\n", ""),),
           ("tests/test_adapter_errors.py::test_weights_beyond_the_models_dtype",
            "tests/test_adapter_errors.py::test_scaling_beyond_float32")),
    Mutant("dp_replay_variant_from_own_rows",
           "DP: a graph replay left to pick its variant follows this rank's own rows, so a "
           "rank serving only the base model drops its peers' MLP LoRA",
           "graphs/runner.py",
           (("        step_lora = (batch.gathered.has_adapters if batch.gathered is not None\n"
             "                     else (idle and self.dp is not None) or batch.has_adapters)\n",
             "        step_lora = (idle and self.dp is not None) or batch.has_adapters\n"),),
           ("tests/test_graph_hunt6.py::test_a_dp_replay_left_to_pick_its_variant_keeps_its_"
            "peers_lora",)),
    Mutant("manager_pin_ignores_running_requests",
           "the manager's own pin under a serving engine takes a decoding request's slot",
           "lora_runtime/lora/manager.py",
           (("            self._check_room_to_pin(name)\n            self._acquire(",
             "            self._acquire("),),
           ("tests/test_adapter_hunt6.py::test_the_managers_pin_leaves_the_decoding_requests_"
            "their_slots",)),
    Mutant("scheduler_counts_overtakes_by_position",
           "the overtake count stays with the head of the queue's position, not its request "
           "(a request that becomes the oldest within a step is passed uncounted)",
           "lora_runtime/engine/scheduler.py",
           (("        if req is not self._head:\n            self._head, self._overtaken = req, 0",
             "        if req is not self._head:\n            self._head = req"),),
           ("tests/test_engine_hunt7.py",)),
    Mutant("one_launch_tiles_count_groups_across_slices",
           "the one-launch tile rule counts groups over the summed tiles, not slice by slice",
           "kernels/config.py",
           (("           and num_blocks * sum(cdiv(n, tiles) for n in slice_tiles) > sms):",
             "           and num_blocks * cdiv(sum(slice_tiles), tiles) > sms):"),),
           ("tests/test_kernel_hunt7.py::test_one_launch_tiles_count_each_slices_own_groups",)),
]


def _tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def _copy_tree(dst: Path) -> None:
    for f in _tree_files():
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst / f)


def _apply(tree: Path, m: Mutant) -> None:
    f = tree / m.path
    text = f.read_text()
    for old, new in m.edits:
        if text.count(old) != 1:
            raise SystemExit(f"mutant {m.name}: the code it mutates changed in {m.path} "
                             f"(found {text.count(old)} times): update tests/mutants.py")
        text = text.replace(old, new)
    f.write_text(text)


def _run(tree: Path, scale: float, timeout: int,
         tests: tuple[str, ...] = ()) -> tuple[int, str, float]:
    env = dict(os.environ, SCHEDULE_SCALE=str(scale), SCHEDULE_NO_SHRINK="1",
               PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                            *(tests or TESTS)], cwd=tree, env=env, capture_output=True,
                           text=True,
                           timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout}s\n{e.stdout or ''}"
    return rc, out, time.perf_counter() - t0


def _first_failure(out: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return m.group(1) if m else "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", default=[], help="run these mutants only")
    p.add_argument("--list", action="store_true")
    p.add_argument("--scale", type=float, default=0.4, help="schedule budget per run")
    p.add_argument("--timeout", type=int, default=900)
    args = p.parse_args(argv)
    unknown = [n for n in args.only if n not in {m.name for m in MUTANTS}]
    if unknown:
        p.error(f"--only {' '.join(unknown)}: no such mutant (python tests/mutants.py --list "
                "names them)")
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34} {m.breaks}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        base = Path(tmp) / "baseline"
        _copy_tree(base)
        print(f"baseline: the stale-state tests on the unmutated tree (schedule scale "
              f"{args.scale}) ...", flush=True)
        every = tuple(TESTS) + tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        rc, out, dt = _run(base, args.scale, args.timeout, every)
        if rc != 0:
            print(out[-3000:])
            print(f"baseline: the unmutated tree fails its own tests (rc={rc}); fix that first")
            return 2
        print(f"baseline passes ({dt:.0f}s)", flush=True)
        killed = 0
        for i, m in enumerate(chosen):
            print(f"[{i + 1}/{len(chosen)}] {m.name}: {m.breaks} ...", flush=True)
            tree = Path(tmp) / m.name
            _copy_tree(tree)
            _apply(tree, m)
            rc, out, dt = _run(tree, args.scale, args.timeout, m.tests)
            ok = rc == 1
            killed += ok
            verdict = f"killed by {_first_failure(out)}" if ok else f"SURVIVED (rc={rc})"
            print(f"{m.name:34} {verdict}  ({dt:.0f}s)\n{'':34} breaks: {m.breaks}", flush=True)
            shutil.rmtree(tree, ignore_errors=True)
    print(f"\nmutants killed: {killed}/{len(chosen)}")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    raise SystemExit(main())
