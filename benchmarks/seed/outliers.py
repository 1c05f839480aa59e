"""Outlier features: why rounding activations to int8 with one scale fails, and the weight outliers.

The chapter's residual-stream experiment. An ~84-token prompt from the book goes through the engine once
(one prefill step); a forward hook on every decoder layer captures the residual stream h [tokens, hidden].

1. Per layer: the largest |h| of each hidden dimension; the top dimensions and the median dimension's max
   (the same few dimensions dominate layer after layer: a property of the trained model, not the input).
2. The histogram of those per-dimension maxima at a middle layer, in octaves.
3. int8 with one tensor-wide scale (max|h| / 127): how many distinct levels ordinary dimensions get, and
   again after excluding the top-k dimensions from the scale.
4. The weight-outlier line for the worst projection matrix (largest max|w| / std): mean |w|, std, max/std,
   count beyond 6 sigma.

The bundled SmolLM2's weights are the GGUF's Q4_1 values dequantized: the numbers are those of that model.

    python benchmarks/seed/outliers.py [--model M] [--tokens 84] [--top-k 4] [--json out.json]
"""

from __future__ import annotations

import math

import torch

from pagedserve.benchmarks.common import table
from pagedserve.benchmarks.seed import common


def residual_stream(loaded: common.Loaded, ids: list[int]) -> list[torch.Tensor]:
    """h after every decoder layer, fp32 [tokens, hidden], from one real engine prefill."""
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().float().clone()))
             for layer in loaded.model.layers]
    try:
        eng = common.engine(loaded, num_blocks=common.blocks_for(len(ids)), enable_prefix_caching=False,
                            max_num_batched_tokens=max(256, len(ids)))
        eng.add_request("outliers", ids, common.greedy(1))
        common.run_all(eng)
    finally:
        for h in hooks:
            h.remove()
    return captured[:len(loaded.model.layers)]  # the prefill step's pass


def octave_histogram(values: torch.Tensor) -> list[tuple[float, float, int]]:
    top = max(1.0, float(values.max()))
    edges = [0.0, 1.0]
    while edges[-1] < top:
        edges.append(edges[-1] * 2)
    return [(lo, hi, int(((values >= lo) & (values < hi)).sum())) for lo, hi in zip(edges, edges[1:])]


def int8_levels(h: torch.Tensor, scale: float) -> torch.Tensor:
    """Distinct int8 codes per dimension under one scale."""
    q = torch.round(h / scale).clamp(-128, 127)
    return torch.tensor([q[:, d].unique().numel() for d in range(h.shape[1])])


def weight_outliers(model) -> dict:
    from pagedserve.engine.layers.linear import Linear

    worst = None
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or name == "lm_head" or m.weight is None or m.weight.numel() == 0:
            continue
        w = m.weight.detach().float()
        std = w.std().item()
        ratio = w.abs().max().item() / std
        if worst is None or ratio > worst["max_over_std"]:
            worst = {"matrix": name, "shape": list(w.shape), "mean_abs": w.abs().mean().item(), "std": std,
                     "max_abs": w.abs().max().item(), "max_over_std": ratio,
                     "beyond_6_sigma": int((w.abs() > 6 * std).sum()), "numel": w.numel()}
    return worst


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=84)
    ap.add_argument("--top-k", type=int, default=4, help="dimensions excluded from the second scale")
    ap.add_argument("--layer", type=int, default=None, help="histogram layer (default: 2/3 of the depth)")
    args = ap.parse_args(argv)
    result = common.setup(args)
    loaded = common.load(args.model, "float32", "cpu")  # fp32: the activations' own magnitudes
    cfg = loaded.config
    ids = common.book_ids(loaded, 24 if args.quick else args.tokens)
    hs = residual_stream(loaded, ids)
    dim_max = torch.stack([h.abs().amax(dim=0) for h in hs])  # [layers, hidden]
    result.update(model=loaded.name, tokens=len(ids), hidden=cfg.hidden_size)

    rows, per_layer = [], []
    for i, m in enumerate(dim_max):
        top_v, top_d = m.topk(3)
        per_layer.append({"layer": i, "top_dims": top_d.tolist(), "top_max": top_v.tolist(),
                          "median_dim_max": m.median().item()})
        rows.append([i, ", ".join(f"{d}: {v:,.1f}" for d, v in zip(top_d.tolist(), top_v.tolist())),
                     f"{m.median().item():.2f}"])
    table(["layer", "top dims (max |h|)", "median dim max"], rows,
          f"Residual stream, {len(ids)} tokens, {cfg.hidden_size} dims: largest |h| per dimension")
    result["per_layer"] = per_layer

    layer = args.layer if args.layer is not None else (2 * cfg.num_layers) // 3
    hist = octave_histogram(dim_max[layer])
    peak = max(c for *_, c in hist)
    print(f"\nHistogram of the {cfg.hidden_size} per-dimension maxima at layer {layer}:")
    for lo, hi, c in hist:
        print(f"  {lo:7g} - {hi:7g} | {'#' * (0 if c == 0 else max(1, round(40 * c / peak))):<40} {c}")
    result["histogram"] = {"layer": layer, "bins": [{"lo": lo, "hi": hi, "count": c} for lo, hi, c in hist]}

    h = hs[layer]
    m = dim_max[layer]
    scale = m.max().item() / 127
    order = m.argsort(descending=True)
    k = args.top_k
    rest_scale = m[order[k:]].max().item() / 127
    # three ordinary dimensions: at the 90th, 75th and 50th percentile of the per-dimension maxima
    picks = [order[int(len(order) * q)].item() for q in (0.10, 0.25, 0.50)]
    levels_all = int8_levels(h, scale)
    levels_rest = int8_levels(h, rest_scale)
    print(f"\nint8 at layer {layer}: single tensor-wide scale = {scale:.4f}; "
          f"distinct levels used by the whole tensor: {torch.round(h / scale).unique().numel()} of 256")
    for d in picks:
        print(f"  dim {d:4d} (max |h| = {m[d].item():.2f}): {levels_all[d].item()} distinct level(s) out of 256")
    print(f"after excluding the top {k} dimensions, scale = {rest_scale:.4f} ({scale / rest_scale:.0f}x smaller)")
    print("  " + "    ".join(f"dim {d}: {levels_rest[d].item()} levels" for d in picks))
    ordinary = order[k:]
    result["int8"] = {
        "layer": layer, "scale": scale, "scale_without_top_k": rest_scale, "top_k": k,
        "top_dims": order[:k].tolist(), "examples": [{"dim": d, "max_abs": m[d].item(), "levels": int(levels_all[d]),
                                                      "levels_without_top_k": int(levels_rest[d])} for d in picks],
        "median_levels_ordinary": float(levels_all[ordinary].float().median()),
        "median_levels_ordinary_without_top_k": float(levels_rest[ordinary].float().median()),
    }

    w = weight_outliers(loaded.model)
    print(f"\n{w['matrix']}.weight   ({w['shape'][0]} x {w['shape'][1]})")
    print(f"mean |w| {w['mean_abs']:.5f}   std {w['std']:.5f}   max |w| {w['max_abs']:.5f}   "
          f"max/std {w['max_over_std']:.1f}")
    print(f"weights beyond 6 sigma: {w['beyond_6_sigma']:,} of {w['numel']:,}   "
          f"({100 * w['beyond_6_sigma'] / w['numel']:.3f} %)")
    result["weight_outliers"] = w

    top_share = m[order[0]].item() / max(m.median().item(), 1e-9)
    gain = result["int8"]["median_levels_ordinary_without_top_k"] / max(result["int8"]["median_levels_ordinary"], 1)
    checks = {
        "an outlier dimension dwarfs the median one": (top_share > 20, f"max/median dim max = {top_share:.0f}x"),
        "excluding the top dims gives ordinary dims more int8 levels": (
            gain > 1.5 or math.isclose(scale, rest_scale), f"median levels x{gain:.1f}"),
        "the same dimensions lead across layers": (
            len({p["top_dims"][0] for p in per_layer[1:]}) <= max(3, cfg.num_layers // 4),
            f"{len({p['top_dims'][0] for p in per_layer[1:]})} distinct top dims over {cfg.num_layers - 1} layers"),
    }
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
