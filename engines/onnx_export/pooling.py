"""sentence-transformers' Pooling over the attention mask: its modes, concatenated in their
order, and the prompt tokens a pooling leaves out (include_prompt false).

A new pooling mode is one branch of `pool` (and its name in worker.core.st_pipeline.PoolingMode).
Name its float nodes pooled_* and its integer and boolean index nodes pool_index_*: an FP16
TensorRT build keeps the float ones in FP32, found by name (head.FP32_NODE_PREFIXES).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from engines.onnx_export.graph import ExportError, Graph, f32, i64, seq_len


def without_prompt(g: Graph, attention_mask: str, n: int) -> str:
    """The mask with its first n positions off: the prompt's tokens (include_prompt false), which
    lead every row (rows are right-padded), are attended to but not pooled."""
    positions = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), seq_len(g, attention_mask),
                               g.const("one_scalar", np.asarray(1, dtype=np.int64))], "pool_index_positions")
    after = g.op("GreaterOrEqual", [positions, g.const("prompt_tokens", np.asarray(n, dtype=np.int64))],
                 "pool_index_after_prompt")
    keep = g.op("Cast", [after], "pool_index_keep", to=TensorProto.INT64)
    return g.op("Mul", [attention_mask, keep], "pool_index_mask")  # [B, S] int64


def row_pick(g: Graph, mode: str, mask: str) -> str:
    """[B, 1, S] (cls: [1, 1, S]) float32, 1 at the one position a single-row pooling takes and 0
    elsewhere, as `pool` takes it: cls position 0; lasttoken the row's last masked position (no
    position for a row with none). Computed in integers, so positions past fp16's 2048 stay exact."""
    one = np.asarray(1, dtype=np.int64)
    end = g.op("Add", [seq_len(g, mask), g.const("one_scalar", one)], "pool_index_end")
    steps = g.op("Range", [g.const("one_scalar", one), end, g.const("one_scalar", one)], "pool_index_range")
    if mode == "cls":
        hit = g.op("Equal", [steps, g.const("one_scalar", one)], "pool_index_first")
        hit = g.op("Unsqueeze", [hit, g.const("axes01", i64(0, 1))], "pool_index_first_u")
    elif mode == "lasttoken":
        score = g.op("Mul", [mask, steps], "pool_index_last_score")  # [B, S] int64
        best = g.op("ReduceMax", [score], "pool_index_last_best", axes=[1], keepdims=1)
        hit = g.op("And", [g.op("Equal", [score, best], "pool_index_last_eq"),
                           g.op("Cast", [mask], "pool_index_last_mask", to=TensorProto.BOOL)], "pool_index_last")
        hit = g.op("Unsqueeze", [hit, g.const("axis1", i64(1))], "pool_index_last_u")
    else:
        raise ExportError(f"pooling mode {mode!r} does not take one row")
    return g.op("Cast", [hit], "row_pick", to=TensorProto.FLOAT)


def pool(g: Graph, modes: tuple[str, ...], hidden_states: str, mask: str, *, prompt_excluded: bool) -> str:
    """sentence-transformers' Pooling over the mask, the modes concatenated in their order.

    Each mode is written as sentence-transformers 6.x computes it (Pooling._forward_padded), for
    right-padded rows: mean and mean_sqrt_len_tokens divide the masked sum by the count (clamped
    at 1e-9) or its root; max takes the maximum over masked positions (-inf elsewhere);
    weightedmean weighs position p (from 1) by p; lasttoken takes the last masked position (zeros
    for a row with none); cls takes the first masked position, which is position 0 unless the
    prompt is left out (position 0 for a row with none masked).
    """
    parts: list[str] = []
    cache: dict[str, str] = {}
    single = len(modes) == 1

    def name(mode: str) -> str:
        return "pooled" if single else f"pooled_{mode}"

    def float_mask() -> str:  # [B, S, 1] float32
        if "m" not in cache:
            cache["m"] = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("axis2", i64(2))], "pool_mask_u")],
                              "pool_mask", to=TensorProto.FLOAT)
        return cache["m"]

    def masked_sum_and_count() -> tuple[str, str]:
        if "sum" not in cache:
            m = float_mask()
            cache["sum"] = g.op("ReduceSum", [g.op("Mul", [hidden_states, m], "masked_states"),
                                              g.const("axis1", i64(1))], "pool_sum", keepdims=0)  # [B, H]
            count = g.op("ReduceSum", [m, g.const("axis1", i64(1))], "pool_count", keepdims=0)  # [B, 1]
            cache["count"] = g.op("Max", [count, g.const("count_min", f32(1e-9))], "pool_count_c")
        return cache["sum"], cache["count"]

    def positions() -> tuple[str, str]:  # ([1, S, 1] float32 1..S, [1, S, 1] bool: position 1)
        if "pos" not in cache:
            one = np.asarray(1, dtype=np.int64)
            end = g.op("Add", [seq_len(g, mask), g.const("one_scalar", one)], "pool_index_end")
            steps = g.op("Range", [g.const("one_scalar", one), end, g.const("one_scalar", one)], "pool_index_range")
            steps = g.op("Unsqueeze", [steps, g.const("axes02", i64(0, 2))], "pool_index_range_u")
            cache["pos"] = g.op("Cast", [steps], "pooled_positions", to=TensorProto.FLOAT)
            cache["first"] = g.op("Equal", [steps, g.const("one_scalar", np.asarray(1, dtype=np.int64))],
                                  "pool_index_first")
        return cache["pos"], cache["first"]

    def pick(score: str, select: str | None, mode: str) -> str:
        # The row's one position of highest score, as a one-hot [B, S, 1] weighting (exact: the
        # other positions add zeros); `select` zeroes it where that position must not count.
        best = g.op("ReduceMax", [score], "pooled_best", axes=[1], keepdims=1)
        onehot = g.op("Cast", [g.op("Equal", [score, best], "pool_index_pick")], "pooled_pick", to=TensorProto.FLOAT)
        if select is not None:
            onehot = g.op("Mul", [onehot, select], "pooled_pick_masked")
        return g.op("ReduceSum", [g.op("Mul", [hidden_states, onehot], "pooled_pick_states"),
                                  g.const("axis1", i64(1))], name(mode), keepdims=0)

    for mode in modes:
        if mode == "mean":
            summed, count = masked_sum_and_count()
            # sentence-transformers clamps the count at 1e-9 (an all-padding row gives zeros, not NaN).
            parts.append(g.op("Div", [summed, count], name(mode)))
        elif mode == "mean_sqrt_len_tokens":
            summed, count = masked_sum_and_count()
            parts.append(g.op("Div", [summed, g.op("Sqrt", [count], "pool_count_sqrt")], name(mode)))
        elif mode == "cls" and not prompt_excluded:
            parts.append(g.op("Gather", [hidden_states, g.const("zero_scalar", np.asarray(0, dtype=np.int64))],
                              name(mode), axis=1))
        elif mode == "cls":
            # The first masked position: score S + 1 - p there, 0 on the others, and 0.5 at
            # position 1, so a row with nothing masked takes position 0 as argmax does.
            pos, first = positions()
            span = g.op("Add", [g.op("ReduceMax", [pos], "pooled_span", axes=[1], keepdims=1),
                                g.const("one_f", f32(1.0))], "pooled_span_1")
            score = g.op("Mul", [float_mask(), g.op("Sub", [span, pos], "pooled_from_end")], "pooled_cls_score")
            first_f = g.op("Cast", [first], "pooled_first", to=TensorProto.FLOAT)
            bonus = g.op("Mul", [first_f, g.const("half", f32(0.5))], "pooled_first_half")
            parts.append(pick(g.op("Add", [score, bonus], "pooled_cls_scored"), None, mode))
        elif mode == "lasttoken":
            pos, _ = positions()
            parts.append(pick(g.op("Mul", [float_mask(), pos], "pooled_last_score"), float_mask(), mode))
        elif mode == "max":
            keep = g.op("Cast", [float_mask()], "pool_index_keep_bool", to=TensorProto.BOOL)
            filled = g.op("Where", [keep, hidden_states, g.const("minus_inf", f32(-np.inf))], "pooled_max_fill")
            parts.append(g.op("ReduceMax", [filled], name(mode), axes=[1], keepdims=0))
        elif mode == "weightedmean":
            pos, _ = positions()
            weights = g.op("Mul", [float_mask(), pos], "pooled_weights")  # [B, S, 1]
            total = g.op("ReduceSum", [g.op("Mul", [hidden_states, weights], "pooled_weighted_states"),
                                       g.const("axis1", i64(1))], "pooled_weighted_sum", keepdims=0)
            count = g.op("ReduceSum", [weights, g.const("axis1", i64(1))], "pooled_weight_total", keepdims=0)
            count = g.op("Max", [count, g.const("count_min", f32(1e-9))], "pooled_weight_total_c")
            parts.append(g.op("Div", [total, count], name(mode)))
        else:
            raise ExportError(f"pooling mode {mode!r} is not supported")
    return parts[0] if single else g.op("Concat", parts, "pooled", axis=-1)
